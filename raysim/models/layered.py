"""Layer-plan networks (VGG, MobileNet-v1) with optional normalisation and Fed2's structure
adaptation: the last `grouped_layers` layers split into `groups` parameter groups.

A plan is a list of convolutional items -- ("conv", out) 3x3, ("dws", out, stride) a
depthwise-separable block (MobileNet-v1), "M" a 2x2 max pool, "A" global average pooling --
then fully connected widths, then the classifier. Layers are the conv items, the fully
connected layers and the classifier (a depthwise-separable block counts as one layer).

Grouping (Fed2, Yu et al. KDD 2021, Sec. 4): in the last L layers every layer's outputs are
cut into G equal groups (widths rounded up to a multiple of G, e.g. 128 -> 130 at G = 10, so
groups are equal and PyTorch's grouped convolution applies). The first grouped layer reads
all of the shared features; every later one reads only its own group's (grouped
convolutions `groups=G`, block-diagonal fully connected layers); the classifier is
decoupled: the logits of the classes allocated to group g read only group g's features, so
class c's gradient reaches no parameter of another group (tested). GroupNorm in the grouped
layers has one normalisation group per structure group (G groups), so it keeps the
isolation; in shared layers it has gcd(32, channels) groups. `parameter_groups()` says
which rows (dim 0) of which parameters belong to which group: what Fed2's paired averaging
needs. No public code of the Fed2 authors was found; VGG-9 is FedMA's (IBM/FedMA).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from raysim.models.base import EncoderHead

NORMS = ("none", "batch", "group")
ALLOCATIONS = ("blocks", "round_robin")


def class_groups(num_classes: int, groups: int, allocation: str = "blocks") -> torch.Tensor:
    """Group of each class: `blocks` gives group g the classes c with floor(c G / C) = g
    (consecutive classes, C/G each when G divides C), `round_robin` c mod G."""
    c = torch.arange(num_classes)
    return c % groups if allocation == "round_robin" else c * groups // num_classes


class GroupedLinear(nn.Module):
    """Block-diagonal linear layer: input group g (in_g features) -> output group g."""

    def __init__(self, groups: int, in_per_group: int, out_per_group: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups, out_per_group, in_per_group))
        self.bias = nn.Parameter(torch.empty(groups, out_per_group))
        bound = 1 / math.sqrt(in_per_group)  # nn.Linear's initialisation, per block
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        xg = x.reshape(n, self.groups, -1).transpose(0, 1)  # (G, N, in_g)
        out = torch.baddbmm(self.bias.unsqueeze(1), xg, self.weight.transpose(1, 2))  # (G, N, out_g)
        return out.transpose(0, 1).reshape(n, -1)


class DecoupledClassifier(nn.Module):
    """Group g's classes' logits from group g's features only (one linear map per group)."""

    def __init__(self, feature_dim: int, class_group: torch.Tensor):
        super().__init__()
        self.groups = int(class_group.max()) + 1
        members = [torch.nonzero(class_group == g).flatten() for g in range(self.groups)]
        f = feature_dim // self.groups
        self.heads = nn.ModuleList(nn.Linear(f, len(m)) for m in members)
        order = torch.cat(members)
        self.register_buffer("position", torch.argsort(order), persistent=False)  # class -> column

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.reshape(x.shape[0], self.groups, -1).unbind(1)
        return torch.cat([h(p) for h, p in zip(self.heads, parts)], dim=1)[:, self.position]


def _norm(kind: str, channels: int, groups: Optional[int]) -> list[nn.Module]:
    if kind == "batch":
        return [nn.BatchNorm2d(channels)]
    if kind == "group":
        return [nn.GroupNorm(groups or math.gcd(32, channels), channels)]
    return []


class LayeredNet(EncoderHead):
    """An `EncoderHead` built from a plan, which knows its parameter groups."""

    def __init__(self, encoder: nn.Module, head: nn.Module, feature_dim: int, grouped: list, groups: int,
                 class_group: Optional[torch.Tensor]):
        super().__init__(encoder, feature_dim, 0, head=head)
        self.groups = groups
        self._grouped = grouped  # modules whose outputs (dim 0 of their parameters) are cut into groups
        if class_group is not None:
            self.register_buffer("class_group", class_group, persistent=False)
        else:
            self.class_group = None

    def parameter_groups(self, buffers: bool = False) -> dict[str, torch.Tensor]:
        """{state key: group of each row along dim 0} for the grouped parameters (and, with
        `buffers`, the grouped layers' floating-point buffers: BatchNorm's running statistics
        of a group's channels); every entry not named is shared. Empty for an ungrouped
        network."""
        name_of = {id(m): n for n, m in self.named_modules()}
        out = {}
        for m in self._grouped:
            entries = list(m.named_parameters(recurse=False))
            if buffers:
                entries += [(n, b) for n, b in m.named_buffers(recurse=False) if b.is_floating_point()]
            for pname, p in entries:
                rows = p.shape[0]
                out[f"{name_of[id(m)]}.{pname}"] = torch.arange(rows) // (rows // self.groups)
        if isinstance(self.head, DecoupledClassifier):
            for g, h in enumerate(self.head.heads):
                for pname, p in h.named_parameters():
                    out[f"{name_of[id(h)]}.{pname}"] = torch.full((p.shape[0],), g)
        return out


def count_layers(plan: list, fcs: list) -> int:
    return sum(1 for v in plan if isinstance(v, tuple)) + len(fcs) + 1


def build(input_shape: tuple, num_classes: int, plan: list, fcs: list, norm: str = "none", groups: int = 1,
          grouped_layers: int = 0, allocation: str = "blocks") -> LayeredNet:
    """The network of `plan` (module docstring); `grouped_layers` > 0 groups the last ones."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")
    total = count_layers(plan, fcs)
    if grouped_layers and not (groups >= 2 and 2 <= grouped_layers <= total and groups <= num_classes):
        raise ValueError(f"grouping needs 2 <= grouped_layers <= {total} (the model's layers) and "
                         f"2 <= groups <= {num_classes} (the classes), got grouped_layers={grouped_layers}, "
                         f"groups={groups}")
    first_grouped = total - grouped_layers if grouped_layers else total + 1  # index of the first grouped layer
    G = groups
    grouped: list[nn.Module] = []
    layer = 0

    def width(out: int, is_grouped: bool) -> int:
        return -(-out // G) * G if is_grouped else out

    def part(module: nn.Module, is_grouped: bool) -> nn.Module:
        if is_grouped:
            grouped.append(module)
        return module

    layers: list[nn.Module] = []
    c = input_shape[0]
    for v in plan:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        if v == "A":
            layers.append(nn.AdaptiveAvgPool2d(1))
            continue
        gout, gin = layer >= first_grouped, layer > first_grouped
        if v[0] == "conv":
            cout = width(v[1], gout)
            layers += [part(nn.Conv2d(c, cout, 3, padding=1, groups=G if gin else 1), gout),
                       *(part(m, gout) for m in _norm(norm, cout, G if gout else None)), nn.ReLU()]
        else:  # depthwise-separable block: depthwise 3x3 (per channel), pointwise 1x1
            _, out, stride = v
            cout = width(out, gout)
            layers += [part(nn.Conv2d(c, c, 3, stride, 1, groups=c, bias=False), gin),
                       *(part(m, gin) for m in _norm(norm, c, G if gin else None)), nn.ReLU(),
                       part(nn.Conv2d(c, cout, 1, groups=G if gin else 1, bias=False), gout),
                       *(part(m, gout) for m in _norm(norm, cout, G if gout else None)), nn.ReLU()]
        c = cout
        layer += 1
    body = nn.Sequential(*layers, nn.Flatten())
    with torch.no_grad():
        d = int(body(torch.zeros(1, *input_shape)).numel())
    fc: list[nn.Module] = []
    for out in fcs:
        gout, gin = layer >= first_grouped, layer > first_grouped
        dout = width(out, gout)
        lin = GroupedLinear(G, d // G, dout // G) if gin else nn.Linear(d, dout)
        fc += [part(lin, gout), nn.ReLU()]
        d = dout
        layer += 1
    encoder = nn.Sequential(body, *fc) if fc else body
    cg = class_groups(num_classes, G, allocation) if grouped_layers else None
    head = DecoupledClassifier(d, cg) if grouped_layers else nn.Linear(d, num_classes)
    return LayeredNet(encoder, head, d, grouped, G, cg)
