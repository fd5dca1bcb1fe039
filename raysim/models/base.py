"""The shape every model has: `encoder` (inputs -> feature vector) and `head` (the classifier
on it), so algorithms that work on features (FedConcat, CReFF, FedRS, ...) can reach either
part by name."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class EncoderHead(nn.Module):
    def __init__(self, encoder: nn.Module, feature_dim: int, num_classes: int, head: Optional[nn.Module] = None):
        super().__init__()
        self.encoder = encoder
        self.feature_dim = feature_dim
        self.head = head if head is not None else nn.Linear(feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))
