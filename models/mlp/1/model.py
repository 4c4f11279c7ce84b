"""The benchmark MLP: FP32 [512] -> 512 -> 2048 -> 2048 -> 512, ReLU between layers.

Weights come from a fixed seed, so every process builds the same model without a download.
"""

from collections.abc import Mapping

import torch
from torch import nn

SEED = 20240512
WIDTH = 512
HIDDEN = 2048


def build_model(parameters: Mapping[str, str]) -> nn.Module:
    # fork_rng keeps the process's global generator where it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = nn.Sequential(
            nn.Linear(WIDTH, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, WIDTH),
        )
    model.eval()
    # A traced module releases the GIL for its whole forward, not around each op.
    with torch.no_grad():
        return torch.jit.trace(model, torch.zeros(2, WIDTH))
