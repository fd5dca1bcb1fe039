"""Training-time augmentation of a client's batch, drawn from the client's generator (so a
run stays a function of its seed). `local.augment` picks one:

- `colour` (or `true`): FedEntOpt's colour jitter, horizontal flip, random greyscale;
- `crop_flip`: NIID-Bench's (and FedConcat's code's) CIFAR recipe: reflect-pad 4 pixels,
  random 32x32 (input-sized) crop, horizontal flip with p = 0.5;
- `false` / `none`: no augmentation.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F


class ColourAugment:
    """FedEntOpt's training augmentation on a batch of standardised colour images: colour
    jitter (brightness, contrast and saturation factors uniform in [1 - j, 1 + j], j = 0.4:
    the paper gives no strength, this is torchvision's common choice), horizontal flip
    with p = 0.5, greyscale with p = 0.1; each image draws its own, from the client's
    generator. Works on [0, 1] pixels, then standardises again."""

    def __init__(self, mean, std, jitter: float = 0.4, flip: float = 0.5, grey: float = 0.1):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.jitter, self.flip, self.grey = jitter, flip, grey

    @staticmethod
    def _grey(img: torch.Tensor) -> torch.Tensor:
        return (0.299 * img[:, 0:1] + 0.587 * img[:, 1:2] + 0.114 * img[:, 2:3]).expand_as(img)

    def __call__(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        n, dev = x.shape[0], x.device
        mean, std = self.mean.to(dev), self.std.to(dev)

        def draw(lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
            return (torch.rand(n, 1, 1, 1, generator=g) * (hi - lo) + lo).to(dev)

        j = self.jitter
        img = (x * std + mean) * draw(1 - j, 1 + j)  # brightness
        m = self._grey(img).mean((1, 2, 3), keepdim=True)
        img = (img - m) * draw(1 - j, 1 + j) + m  # contrast
        grey = self._grey(img)
        img = ((img - grey) * draw(1 - j, 1 + j) + grey).clamp(0, 1)  # saturation
        img = torch.where(draw() < self.flip, img.flip(-1), img)
        img = torch.where(draw() < self.grey, self._grey(img), img)
        return (img - mean) / std


class CropFlip:
    """Reflect-pad `pad` pixels, crop a random window of the input's size, flip horizontally
    with probability `flip`; each image draws its own offsets and flip."""

    def __init__(self, pad: int = 4, flip: float = 0.5):
        self.pad, self.flip = pad, flip

    def __call__(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        n, _, h, w = x.shape
        padded = F.pad(x, (self.pad,) * 4, mode="reflect")
        dy = torch.randint(0, 2 * self.pad + 1, (n,), generator=g).to(x.device)
        dx = torch.randint(0, 2 * self.pad + 1, (n,), generator=g).to(x.device)
        flip = (torch.rand(n, generator=g) < self.flip).to(x.device)
        rows = dy[:, None] + torch.arange(h, device=x.device)[None, :]  # (n, h)
        cols = dx[:, None] + torch.arange(w, device=x.device)[None, :]  # (n, w)
        cols = torch.where(flip[:, None], cols.flip(1), cols)
        batch = torch.arange(n, device=x.device)[:, None, None]
        out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # (n, h, w, c)
        return out.permute(0, 3, 1, 2).contiguous()


def make_transform(name: str, norm: Optional[tuple]) -> Optional[Callable[[torch.Tensor, torch.Generator], torch.Tensor]]:
    """The batch transform for `local.augment` (already checked), or None."""
    if name == "colour":
        return ColourAugment(*norm)
    if name == "crop_flip":
        return CropFlip()
    return None
