"""A small transformer encoder: INT64 token ids [16] -> mean-pooled FP32 [64] embedding.

Vocabulary 1000, learned positions, ``nn.TransformerEncoder`` with d_model 64, 2 layers and
4 heads, batch first; weights from a fixed seed. There is no padding mask and the nested-tensor
path is off, so a sample's embedding does not depend on the other samples of its batch.
"""

from collections.abc import Mapping

import torch
from torch import nn

SEED = 20240514
VOCAB = 1000
SEQUENCE = 16
D_MODEL = 64


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Parameter(torch.randn(SEQUENCE, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model=D_MODEL,
            nhead=4,
            dim_feedforward=4 * D_MODEL,
            dropout=0.0,
            batch_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.tokens(ids) + self.positions)
        return hidden.mean(dim=1)


def build_model(parameters: Mapping[str, str]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Encoder()
    model.eval()
    with torch.no_grad():
        return torch.jit.trace(model, torch.zeros(2, SEQUENCE, dtype=torch.long))
