"""Every registered model builds for the inputs it is meant for and exposes its encoder / head split."""
import pytest
import torch

from raysim.models import EncoderHead, build_model
from raysim.registry import MODELS

SHAPES = {"mclr": [(60,), (1, 28, 28)], "mlp": [(60,), (1, 8, 8)], "cnn": [(1, 28, 28), (3, 32, 32)],
          "lenet5": [(1, 28, 28), (3, 32, 32)], "vgg9": [(3, 32, 32)], "vgg11": [(3, 32, 32)], "resnet8": [(3, 32, 32)]}


def test_every_registered_model_is_covered():
    assert set(MODELS.names()) == set(SHAPES)


@pytest.mark.parametrize("name,shape", [(n, s) for n, shapes in SHAPES.items() for s in shapes])
def test_model_forward_and_split(name, shape):
    model = build_model(name, shape, 7)
    assert isinstance(model, EncoderHead)
    x = torch.randn(3, *shape)
    feats = model.encoder(x)
    assert feats.shape == (3, model.feature_dim)
    assert torch.allclose(model.head(feats), model(x))
    assert model(x).shape == (3, 7)
