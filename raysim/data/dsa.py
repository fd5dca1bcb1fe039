"""Differentiable Siamese augmentation (DSA; Zhao & Bilen 2021, "Dataset Condensation with
Differentiable Siamese Augmentation"), as CReFF's clients use it on the samples whose
classifier gradients they upload.

`siamese_augment(x, strategy, generator)` picks one of the strategy's ops ('color', 'crop',
'cutout', 'flip', 'scale', 'rotate', joined by '_') uniformly and applies it with one draw of
its parameters shared by the whole batch ("Siamese"): the reference's single-op mode
(`aug_mode='S'`) with its parameters (`ParamDiffAug`: flip p 0.5, scale 1.2, rotate 15 degrees,
crop 1/8 of the side, cutout half the side, brightness 1.0, saturation 2.0, contrast 0.5).
Reference: shangxinyi/CReFF-FL, Dataset/param_aug.py (from the DSA authors' code). Where it
reseeds torch's global generator from the wall clock before each draw, every draw here comes
from the `generator` passed in, so the same (seed, round, client) gives the same augmented
batch whatever actor runs it. Parameters are drawn on the CPU and applied on x's device.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FLIP_P, SCALE, ROTATE_DEG, CROP, CUTOUT = 0.5, 1.2, 15.0, 0.125, 0.5
BRIGHTNESS, SATURATION, CONTRAST = 1.0, 2.0, 0.5
OPS = ("color", "crop", "cutout", "flip", "scale", "rotate")
REFERENCE_STRATEGY = "color_crop_cutout_flip_scale_rotate"


def strategy_ops(strategy: str) -> list[str]:
    """The ops of a strategy string ('none' or '': no op); ValueError names an unknown one."""
    if strategy in ("", "none"):
        return []
    ops = strategy.split("_")
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"unknown augmentation {bad[0]!r}; ops: {', '.join(OPS)} joined by '_', or 'none'")
    return ops


def _uniform(g: torch.Generator, low: float = 0.0, high: float = 1.0) -> float:
    return low + (high - low) * float(torch.rand((), generator=g))


def _randint(g: torch.Generator, low: int, high: int) -> int:
    """An integer in [low, high)."""
    return int(torch.randint(low, high, (), generator=g))


def _affine(x: torch.Tensor, theta: list) -> torch.Tensor:
    t = torch.tensor(theta, dtype=x.dtype, device=x.device).expand(x.shape[0], 2, 3)
    grid = F.affine_grid(t, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, align_corners=False)


def color(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Brightness, saturation, contrast: each a shift or scale drawn once."""
    x = x + (_uniform(g) - 0.5) * BRIGHTNESS
    mean = x.mean(dim=1, keepdim=True)  # per pixel, over channels (one channel: saturation does nothing)
    x = (x - mean) * (_uniform(g) * SATURATION) + mean
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return (x - mean) * (_uniform(g) + CONTRAST) + mean


def crop(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Shift by up to 1/8 of each side, zeros where the image moved away."""
    h, w = x.shape[2], x.shape[3]
    sh, sw = int(h * CROP + 0.5), int(w * CROP + 0.5)
    dy, dx = _randint(g, -sh, sh + 1), _randint(g, -sw, sw + 1)
    out = torch.zeros_like(x)
    src_y, dst_y = slice(max(dy, 0), h + min(dy, 0)), slice(max(-dy, 0), h + min(-dy, 0))
    src_x, dst_x = slice(max(dx, 0), w + min(dx, 0)), slice(max(-dx, 0), w + min(-dx, 0))
    out[:, :, dst_y, dst_x] = x[:, :, src_y, src_x]  # out[i] = x[i + dy]
    return out


def cutout(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Zero a square of half the side, centred at a drawn pixel (clipped at the borders)."""
    h, w = x.shape[2], x.shape[3]
    ch, cw = int(h * CUTOUT + 0.5), int(w * CUTOUT + 0.5)
    cy, cx = _randint(g, 0, h + (1 - ch % 2)), _randint(g, 0, w + (1 - cw % 2))
    y0, x0 = max(cy - ch // 2, 0), max(cx - cw // 2, 0)
    y1, x1 = min(cy - ch // 2 + ch, h), min(cx - cw // 2 + cw, w)
    out = x.clone()
    out[:, :, y0:y1, x0:x1] = 0
    return out


def flip(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Left-right flip with probability 1/2."""
    return x.flip(3) if _uniform(g) < FLIP_P else x


def scale(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Stretch each axis by a factor in [1/1.2, 1.2] (bilinear, zeros outside)."""
    sx, sy = _uniform(g, 1 / SCALE, SCALE), _uniform(g, 1 / SCALE, SCALE)
    return _affine(x, [[sx, 0.0, 0.0], [0.0, sy, 0.0]])


def rotate(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Rotate by an angle in [-15, 15] degrees (bilinear, zeros outside)."""
    a = (_uniform(g) - 0.5) * 2 * ROTATE_DEG / 180 * math.pi
    return _affine(x, [[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0]])


AUGMENTS = {"color": color, "crop": crop, "cutout": cutout, "flip": flip, "scale": scale, "rotate": rotate}


def siamese_augment(x: torch.Tensor, strategy: str, generator: torch.Generator) -> torch.Tensor:
    """One op of `strategy`, drawn from `generator`, applied with the same parameters to every
    sample of the batch x (N, C, H, W). 'none': x unchanged (and nothing drawn)."""
    ops = strategy_ops(strategy)
    if not ops or x.dim() != 4:
        return x
    op = ops[_randint(generator, 0, len(ops))]
    return AUGMENTS[op](x, generator).contiguous()
