"""A small conv net: FP32 image [3, 32, 32] -> [10] logits.

Two conv blocks (conv, ReLU, 2x2 max-pool) and a linear head; weights from a fixed seed.
"""

from collections.abc import Mapping

import torch
from torch import nn

SEED = 20240513
CLASSES = 10


def build_model(parameters: Mapping[str, str]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16 x 16 x 16
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 32 x 8 x 8
            nn.Flatten(),
            nn.Linear(32 * 8 * 8, 64),
            nn.ReLU(),
            nn.Linear(64, CLASSES),
        )
    model.eval()
    with torch.no_grad():
        return torch.jit.trace(model, torch.zeros(2, 3, 32, 32))
