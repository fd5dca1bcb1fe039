"""A plugin for tests: `model=mlp_bn`, a small MLP with BatchNorm in its encoder (the model
zoo's encoder/head split), for the personalised algorithms' buffer rules on models small
enough to follow by hand."""
from torch import nn

from raysim.models.base import EncoderHead
from raysim.registry import MODELS


@MODELS.register("mlp_bn")
def mlp_bn(input_shape: tuple, num_classes: int, hidden: int = 3) -> EncoderHead:
    return EncoderHead(nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1], hidden), nn.BatchNorm1d(hidden), nn.ReLU()),
                       hidden, num_classes)
