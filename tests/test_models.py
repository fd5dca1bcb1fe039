"""Every registered model builds for the inputs it is meant for and exposes its encoder / head split."""
import pytest
import torch

from raysim.models import EncoderHead, build_model
from raysim.registry import MODELS

SHAPES = {"mclr": [(60,), (1, 28, 28)], "mlp": [(60,), (1, 8, 8)], "cnn": [(1, 28, 28), (3, 32, 32)],
          "lenet5": [(1, 28, 28), (3, 32, 32)], "vgg9": [(3, 32, 32)], "vgg11": [(3, 32, 32)], "vgg16": [(3, 32, 32)], "mobilenet": [(3, 32, 32)],
          "resnet8": [(3, 32, 32)],
          "lstm": [(25, 8)]}  # word vectors; token ids: tests/test_leaf.py


def test_every_registered_model_is_covered():
    from raysim.registry import module_of

    built_in = {n for n in MODELS.names() if module_of(MODELS.get(n)).startswith("raysim.")}  # not tests' plugins
    assert built_in == set(SHAPES)


@pytest.mark.parametrize("name,shape", [(n, s) for n, shapes in SHAPES.items() for s in shapes])
def test_model_forward_and_split(name, shape):
    model = build_model(name, shape, 7)
    assert isinstance(model, EncoderHead)
    x = torch.randn(3, *shape)
    feats = model.encoder(x)
    assert feats.shape == (3, model.feature_dim)
    assert torch.allclose(model.head(feats), model(x))
    assert model(x).shape == (3, 7)


def test_resnet8_width_4_is_crefs_model_with_256_features():
    model = build_model("resnet8", (3, 32, 32), 10, {"width": 4})
    assert model.feature_dim == 256 and model.encoder[0].out_channels == 64
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_mlp_hidden_layers_are_an_option_and_fedgroups_mlp_has_its_parameter_count(ray_local, tmp_path):
    from raysim.config import ConfigError, load_config
    from raysim.models import model_from
    from raysim.run import main

    cfg = load_config(overrides=["model_options.hidden=[128]"])
    assert sum(p.numel() for p in model_from(cfg, (1, 28, 28), 10).parameters()) == 101_770  # FedGroup's MLP on MNIST
    with pytest.raises(ConfigError, match="model_options.depth: model 'mlp' takes hidden"):
        load_config(overrides=["model_options.depth=3"])
    with pytest.raises(ConfigError, match="model_options.hidden: model 'cnn' takes norm, width"):
        load_config(overrides=["model=cnn", "model_options.hidden=[8]"])
    # the server and the client actors build the same network
    assert main(["model_options.hidden=[16]", "rounds=2", f"output_dir={tmp_path}", "run_name=h", "--quiet"]) == 0
    weights = torch.load(tmp_path / "h" / "model.pt", weights_only=True)["global"]
    assert [tuple(v.shape) for k, v in weights.items() if k.endswith("weight")] == [(16, 64), (10, 16)]


def test_mlp_and_cnn_take_a_norm_and_a_width_and_width_one_leaves_them_as_they_were():
    """`norm=batch` puts BatchNorm after each hidden layer (FedBN's); `width` scales every
    hidden size, rounded up (HeteroFL's sub-models); width 1 builds the same weights."""
    from torch import nn

    from raysim.config import ConfigError, load_config

    for name, shape in (("mlp", (64,)), ("cnn", (1, 28, 28))):
        torch.manual_seed(0)
        a = build_model(name, shape, 10)
        torch.manual_seed(0)
        b = build_model(name, shape, 10, {"width": 1.0})
        assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
        bn = build_model(name, shape, 10, {"norm": "batch"})
        assert any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) for m in bn.modules())
        assert bn(torch.randn(4, *shape)).shape == (4, 10)
    half = build_model("cnn", (1, 28, 28), 10, {"width": 0.25})
    assert [m.out_channels for m in half.modules() if isinstance(m, nn.Conv2d)] == [2, 4]  # ceil(6/4), 16/4
    with pytest.raises(ConfigError, match="model_options.width must be a number > 0"):
        load_config(overrides=["model=cnn", "model_options.width=0"])


def test_a_vgg_at_a_width_scales_every_conv_and_fc_and_keeps_fed2s_grouping():
    """VGG's `width` (the results table's Fed2 runs a quarter-width VGG-9 to fit a CPU sweep):
    width 1 builds the published weights; a grouped layer still gets a multiple of the groups."""
    from torch import nn

    torch.manual_seed(0)
    a = build_model("vgg9", (1, 28, 28), 10)
    torch.manual_seed(0)
    b = build_model("vgg9", (1, 28, 28), 10, {"width": 1.0})
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    q = build_model("vgg9", (1, 28, 28), 10, {"width": 0.25, "groups": 10, "grouped_layers": 3, "norm": "group"})
    assert [m.out_channels for m in q.modules() if isinstance(m, nn.Conv2d)] == [8, 16, 32, 32, 64, 64]
    assert [m.out_features for m in q.modules() if isinstance(m, nn.Linear)][:1] == [130]  # 128 up to 10 groups
    assert q(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_the_clocks_flop_count_takes_a_model_with_batchnorm_after_a_linear_layer():
    """FedBN's MLP (BatchNorm1d) cannot train on a batch of one: the clock counts a sample's
    FLOPs on the input twice and halves them, the same count a batch of one gives."""
    from torch.utils.flop_counter import FlopCounterMode

    from raysim.world.clock import flops_per_sample

    x = torch.randn(1, 1, 28, 28)
    for name, options in (("cnn", {}), ("mlp", {}), ("cnn", {"norm": "batch"})):
        model = build_model(name, (1, 28, 28), 10, options)
        with FlopCounterMode(display=False) as counter:
            model.train()(x).sum().backward()
        assert flops_per_sample(build_model(name, (1, 28, 28), 10, options), x) == float(counter.get_total_flops())
    bn = build_model("mlp", (1, 28, 28), 10, {"norm": "batch"})
    assert flops_per_sample(bn, x) == flops_per_sample(build_model("mlp", (1, 28, 28), 10), x)
