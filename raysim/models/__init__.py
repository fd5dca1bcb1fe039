"""Model zoo. Every model is an `EncoderHead`: `encoder` maps inputs to a feature vector,
`head` is the linear classifier on it, so algorithms that work on features (FedConcat,
CReFF, FedRS, ...) can reach either part by name."""
from __future__ import annotations

import math

import torch
from torch import nn

from raysim.models import layered
from raysim.models.base import EncoderHead
from raysim.registry import MODELS


def _flat_dim(shape: tuple) -> int:
    return int(math.prod(shape))


@MODELS.register("mclr")
def mclr(input_shape: tuple, num_classes: int) -> EncoderHead:
    """Multinomial logistic regression: the encoder only flattens."""
    return EncoderHead(nn.Flatten(), _flat_dim(input_shape), num_classes)


@MODELS.register("mlp")
def mlp(input_shape: tuple, num_classes: int, hidden: tuple = (200, 200), norm: str = "none",
        width: float = 1.0) -> EncoderHead:
    """ReLU layers of `hidden` sizes: by default two of 200 (McMahan et al.'s MNIST 2NN);
    `model_options.hidden=[128]` is FedGroup's MLP (101,770 parameters on MNIST).
    `norm=batch|group`: a normalisation layer after each hidden linear one (FedBN's).
    `width`: every hidden size times it, rounded up (HeteroFL's model rate)."""
    layers: list[nn.Module] = [nn.Flatten()]
    d = _flat_dim(input_shape)
    for h in (_scaled(h, width) for h in hidden):
        layers += [nn.Linear(d, h), *_norm(norm, h, dims=1), nn.ReLU()]
        d = h
    return EncoderHead(nn.Sequential(*layers), d, num_classes)


def _scaled(size: int, width: float) -> int:
    """A hidden size at `width` (HeteroFL's ceil(rate * size)); width 1 leaves it."""
    return size if width == 1 else max(1, math.ceil(width * size))


def _norm(kind: str, channels: int, dims: int = 2) -> list[nn.Module]:
    """The normalisation after a layer of `channels` outputs: none, batch or group."""
    if kind not in layered.NORMS:
        raise ValueError(f"norm must be one of {', '.join(layered.NORMS)}, got {kind!r}")
    if kind == "batch":
        return [nn.BatchNorm1d(channels) if dims == 1 else nn.BatchNorm2d(channels)]
    return [nn.GroupNorm(math.gcd(32, channels), channels)] if kind == "group" else []


def _conv_features(body: nn.Module, input_shape: tuple) -> int:
    with torch.no_grad():
        return int(body(torch.zeros(1, *input_shape)).numel())


def _lenet_style(input_shape: tuple, num_classes: int, padding: int, norm: str = "none",
                 width: float = 1.0) -> EncoderHead:
    """conv5x5(6)-pool-conv5x5(16)-pool-fc120-fc84 with ReLU and max pooling (`norm`: a
    normalisation layer after each convolution; `width`: every hidden size times it)."""
    c1, c2, f1, f2 = (_scaled(n, width) for n in (6, 16, 120, 84))
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], c1, 5, padding=padding), *_norm(norm, c1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5), *_norm(norm, c2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
    )
    d = _conv_features(body, input_shape)
    enc = nn.Sequential(body, nn.Linear(d, f1), nn.ReLU(), nn.Linear(f1, f2), nn.ReLU())
    return EncoderHead(enc, f2, num_classes)


@MODELS.register("cnn")
def cnn(input_shape: tuple, num_classes: int, norm: str = "none", width: float = 1.0) -> EncoderHead:
    """NIID-Bench's simple CNN (also FedConcat's): the LeNet layers without padding
    (`norm=batch|group`: after each convolution; `width`: hidden sizes times it, HeteroFL's)."""
    return _lenet_style(input_shape, num_classes, padding=0, norm=norm, width=width)


@MODELS.register("lenet5")
def lenet5(input_shape: tuple, num_classes: int) -> EncoderHead:
    """LeNet-5 in its classic geometry: inputs padded to 32x32 (28x28 MNIST gets padding 2)."""
    return _lenet_style(input_shape, num_classes, padding=max(0, (32 - input_shape[-1]) // 2))


MODEL_OPTION_CHOICES = {"norm": layered.NORMS, "allocation": layered.ALLOCATIONS}  # string options' allowed values


def _vgg(input_shape, num_classes, convs: list, norm, groups, grouped_layers, allocation,
         width: float = 1.0) -> EncoderHead:
    """3x3 convs per `convs` ("M" = 2x2 max pool), then fc512-fc512 and the classifier;
    `width`: every conv's channels and both fc sizes times it, rounded up (width 1: as
    published; a narrower VGG fits a CPU sweep: configs/sweeps/results_table.yaml)."""
    plan = [v if v == "M" else ("conv", _scaled(v, width)) for v in convs]
    return layered.build(input_shape, num_classes, plan, [_scaled(512, width)] * 2, norm, groups, grouped_layers,
                         allocation)


@MODELS.register("vgg9")
def vgg9(input_shape: tuple, num_classes: int, norm: str = "none", groups: int = 1, grouped_layers: int = 0,
         allocation: str = "blocks", width: float = 1.0) -> EncoderHead:
    """VGG-9 of FedMA / Fed2: six 3x3 convs (32, 64, pool, 128, 128, pool, 256, 256, pool),
    then fc512-fc512 and the classifier; no normalisation by default (FedMA's)."""
    return _vgg(input_shape, num_classes, [32, 64, "M", 128, 128, "M", 256, 256, "M"],
                norm, groups, grouped_layers, allocation, width)


@MODELS.register("vgg11")
def vgg11(input_shape: tuple, num_classes: int, norm: str = "batch", groups: int = 1, grouped_layers: int = 0,
          allocation: str = "blocks", width: float = 1.0) -> EncoderHead:
    """VGG-11 (configuration A of Simonyan & Zisserman) for 32x32 inputs, as FedEntOpt uses:
    eight 3x3 convs 64-M-128-M-256-256-M-512-512-M-512-512-M with BatchNorm, then
    fc512-fc512 and the classifier."""
    return _vgg(input_shape, num_classes, [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
                norm, groups, grouped_layers, allocation, width)


@MODELS.register("vgg16")
def vgg16(input_shape: tuple, num_classes: int, norm: str = "batch", groups: int = 1, grouped_layers: int = 0,
          allocation: str = "blocks", width: float = 1.0) -> EncoderHead:
    """VGG-16 (configuration D) for 32x32 inputs, as Fed2 uses on CIFAR-100: thirteen 3x3
    convs 64-64-M-128-128-M-256x3-M-512x3-M-512x3-M with BatchNorm, fc512-fc512, classifier."""
    return _vgg(input_shape, num_classes,
                [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
                norm, groups, grouped_layers, allocation, width)


@MODELS.register("mobilenet")
def mobilenet(input_shape: tuple, num_classes: int, norm: str = "batch", groups: int = 1, grouped_layers: int = 0,
              allocation: str = "blocks") -> EncoderHead:
    """MobileNet-v1 (Howard et al. 2017) for 32x32 inputs (the common CIFAR version: first conv
    stride 1): conv3x3(32), thirteen depthwise-separable blocks 64, 128/2, 128, 256/2, 256,
    512/2, 512 x5, 1024/2, 1024 (each a layer), global average pooling, the classifier;
    BatchNorm after every convolution. 15 layers."""
    blocks = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), *[(512, 1)] * 5, (1024, 2), (1024, 1)]
    plan = [("conv", 32), *(("dws", c, s) for c, s in blocks), "A"]
    return layered.build(input_shape, num_classes, plan, [], norm, groups, grouped_layers, allocation)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


@MODELS.register("resnet8")
def resnet8(input_shape: tuple, num_classes: int, width: int = 1) -> EncoderHead:
    """ResNet-8 for CIFAR (FedDF's / CReFF's `ResNet_cifar`, resnet_size=8): conv3x3(16w)
    then three stages of one basic block (16w, 32w, 64w channels, strides 1, 2, 2), global
    average pooling; 64w-d features. `width` is their `scaling`: CReFF's paper model is
    width 4 (64, 128, 256 channels, 256-d features)."""
    c = [16 * width, 32 * width, 64 * width]
    enc = nn.Sequential(
        nn.Conv2d(input_shape[0], c[0], 3, 1, 1, bias=False), nn.BatchNorm2d(c[0]), nn.ReLU(),
        _BasicBlock(c[0], c[0], 1), _BasicBlock(c[0], c[1], 2), _BasicBlock(c[1], c[2], 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )
    return EncoderHead(enc, c[2], num_classes)


class _LastHidden(nn.Module):
    """Token ids (N, L) or word vectors (N, L, D) -> the last LSTM step's hidden state."""

    def __init__(self, embed: nn.Module | None, input_dim: int, hidden: int, layers: int):
        super().__init__()
        self.embed = embed
        self.lstm = nn.LSTM(input_dim, hidden, num_layers=layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x.long())
        out, _ = self.lstm(x)
        return out[:, -1]


@MODELS.register("lstm")
def lstm(input_shape: tuple, num_classes: int, vocab_size: int = 10002, embed_dim: int = 100, hidden: int = 100,
         layers: int = 2) -> EncoderHead:
    """LEAF's Sent140 classifier (the FedGroup paper's LSTM): a `layers`-deep LSTM of `hidden`
    units over the words of a sequence, its last step into the linear head. Inputs (L,):
    token ids (0 padding, 1 unknown), embedded by a trained table of `vocab_size` x
    `embed_dim`; inputs (L, D): word vectors already (frozen pre-trained embeddings, e.g.
    GloVe through `sent140.embeddings`, as LEAF's model keeps them), no table."""
    embed = None
    if len(input_shape) == 1:
        embed, dim = nn.Embedding(vocab_size, embed_dim, padding_idx=0), embed_dim
    else:
        dim = int(input_shape[-1])
    return EncoderHead(_LastHidden(embed, dim, hidden, layers), hidden, num_classes)


def build_model(name: str, input_shape: tuple, num_classes: int, options=None) -> EncoderHead:
    """Model `name` for inputs of `input_shape`; `options`: the factory's own keyword
    arguments (config `model_options`, e.g. mlp's `hidden`)."""
    return MODELS.get(name)(tuple(input_shape), int(num_classes), **(options or {}))


def model_from(cfg, input_shape: tuple, num_classes: int) -> EncoderHead:
    """The run's model: `cfg.model` with `cfg.model_options`."""
    from omegaconf import OmegaConf

    return build_model(cfg.model, input_shape, num_classes, OmegaConf.to_container(cfg.model_options))


def model_option_names(name: str) -> list[str]:
    """The options model `name` takes (its factory's arguments after shape and classes)."""
    return list(model_option_defaults(name))


def model_option_defaults(name: str) -> dict:
    """{option: default} of model `name`'s own arguments."""
    import inspect

    params = list(inspect.signature(MODELS.get(name)).parameters.values())[2:]
    return {p.name: p.default for p in params}


def check_model_options(name: str, options: dict) -> None:
    """The model zoo checks the options a run gives model `name` (config `model_options`):
    each must be an argument of its factory; sizes and counts integers (>= 1, or >= 0 where
    0, the default, means off); named choices one of theirs. A `ConfigError` names the key."""
    from raysim.errors import ConfigError

    takes = model_option_defaults(name)
    for key, value in options.items():
        if key not in takes:
            raise ConfigError(f"model_options.{key}: model {name!r} takes {', '.join(takes) if takes else 'no options'}")
        if isinstance(takes[key], int):  # width, vocab_size, layers, ...
            least = 0 if takes[key] == 0 else 1
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise ConfigError(f"model_options.{key} must be an integer >= {least}, got {value!r}")
        if isinstance(takes[key], float) and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                   and value > 0):
            raise ConfigError(f"model_options.{key} must be a number > 0, got {value!r}")
        if key in MODEL_OPTION_CHOICES and value not in MODEL_OPTION_CHOICES[key]:
            raise ConfigError(f"model_options.{key} must be one of {', '.join(MODEL_OPTION_CHOICES[key])}, "
                              f"got {value!r}")
    hidden = options.get("hidden")
    if not (hidden is None or (isinstance(hidden, (list, tuple))
                               and all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in hidden))):
        raise ConfigError(f"model_options.hidden must be a list of layer sizes >= 1, e.g. [128], got {hidden!r}")
