"""Compressors of what a client sends: encode a flat float32 vector into a bit-packed message
whose length is the bytes that travel, and decode it back (issue 57).

- `TopK` (Stich et al. 2018; Aji & Heafield 2017): the k = ceil(ratio x n) entries of
  largest magnitude; the message is their indices, bit-packed at ceil(log2 n) bits each, and
  their float32 values. Ties go to the lower index (a stable sort), so the choice is
  deterministic.
- `RandK` (Stich et al. 2018): k entries drawn without replacement from a generator both
  ends seed alike ((seed, round, client): the server draws the same indices), so only the
  float32 values travel. Decoded unscaled (a contraction, as error feedback wants);
  `unbiased` scales by n / k instead (an unbiased estimate, higher variance).
- `QSGD` (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient
  Quantization and Encoding"): in buckets of `bucket` entries, each entry becomes
  norm x sign x l / s with s = 2^(bits-1) - 1 levels and l in {floor(r), floor(r)+1},
  r = s |v| / norm, the upper level drawn with probability r - floor(r): unbiased. The
  message is each bucket's float32 L2 norm and, per entry, a sign bit and its level in
  bits - 1 bits (fixed width: the paper's Elias coding of the levels, which saves more at
  low bits, is not applied; the bytes say what this encoding costs).
- `ScaledSign` (Karimireddy et al. 2019, EF-SignSGD): sign bits and one float32, the mean
  magnitude ||v||_1 / n; decoded as that times the signs (the authors' `scaled_sign` in
  epfml/error-feedback-SGD, which scales each parameter tensor by its own mean magnitude:
  `blocks`, `compress.sign_scale=tensor`; a zero entry, whose sign is 0 there, travels as +
  here: one bit). `signs` gives the bare signs for signSGD's majority vote (Bernstein et al. 2018),
  which the server takes.

Randomness (RandK, QSGD) comes only from the generator passed in, so a client's message
depends on (seed, round, client), never on where it was encoded. Reference reading: the
papers' statements above, and TFF's `tff.aggregators` encoders (top-k / stochastic
quantisation as encode / decode pairs with a state of their own) for the split of work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Message:
    """An encoded vector: what travels (`parts`: packed bytes and float32 arrays) and what
    both ends know without sending it (`n`, the codec's settings)."""
    codec: str
    n: int
    parts: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The bytes that travel: every part's length."""
        return int(sum(p.nbytes for p in self.parts.values()))


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Non-negative integers < 2**width as one big-endian bit string, `width` bits each,
    in uint8 (the last byte padded with zeros): ceil(len x width / 8) bytes."""
    values = np.asarray(values, dtype=np.uint64)
    if width == 0 or values.size == 0:
        return np.zeros(0, dtype=np.uint8)
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
    bits = ((values[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.reshape(-1))


def unpack_bits(packed: np.ndarray, width: int, count: int) -> np.ndarray:
    """`pack_bits`' inverse: `count` integers of `width` bits."""
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    bits = np.unpackbits(packed)[:count * width].reshape(count, width).astype(np.uint64)
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
    return (bits << shifts).sum(axis=1).astype(np.int64)


def index_bits(n: int) -> int:
    """Bits for an index into n entries."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


def keep_count(n: int, ratio: float) -> int:
    return max(1, min(n, math.ceil(ratio * n)))


class TopK:
    name = "topk"

    def __init__(self, ratio: float):
        self.ratio = float(ratio)

    def encode(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Message:
        v = v.detach().reshape(-1).float().cpu()
        k = keep_count(v.numel(), self.ratio)
        order = torch.sort(v.abs(), descending=True, stable=True).indices[:k]
        idx = torch.sort(order).values.numpy()
        return Message(self.name, v.numel(), {"indices": pack_bits(idx, index_bits(v.numel())),
                                              "values": v.numpy()[idx].astype(np.float32)})

    def decode(self, m: Message, gen: torch.Generator | None = None) -> torch.Tensor:
        k = len(m.parts["values"])
        idx = unpack_bits(m.parts["indices"], index_bits(m.n), k)
        out = torch.zeros(m.n, dtype=torch.float32)
        out[torch.from_numpy(idx)] = torch.from_numpy(m.parts["values"].copy())
        return out


class RandK:
    name = "randk"

    def __init__(self, ratio: float, unbiased: bool = False):
        self.ratio, self.unbiased = float(ratio), bool(unbiased)

    def indices(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """The k indices both ends draw from the same generator state, in increasing order."""
        return torch.sort(torch.randperm(n, generator=gen)[:keep_count(n, self.ratio)]).values

    def encode(self, v: torch.Tensor, gen: torch.Generator) -> Message:
        v = v.detach().reshape(-1).float().cpu()
        idx = self.indices(v.numel(), gen)
        return Message(self.name, v.numel(), {"values": v[idx].numpy().astype(np.float32)})

    def decode(self, m: Message, gen: torch.Generator) -> torch.Tensor:
        idx = self.indices(m.n, gen)
        out = torch.zeros(m.n, dtype=torch.float32)
        scale = m.n / len(idx) if self.unbiased else 1.0
        out[idx] = torch.from_numpy(m.parts["values"].copy()) * scale
        return out


class QSGD:
    name = "qsgd"

    def __init__(self, bits: int, bucket: int = 512):
        if bits < 2:
            raise ValueError("QSGD needs 2 bits or more per entry (a sign bit and a level)")
        self.bits, self.bucket = int(bits), int(bucket)
        self.levels = 2 ** (self.bits - 1) - 1

    def _bucket(self, n: int) -> int:
        """The bucket's size for an update of n entries: `bucket`, or n where that is larger
        (one norm either way; a bucket of 2e8 padded a 55k-entry update to 2e8 floats)."""
        return max(1, min(self.bucket, n))

    def encode(self, v: torch.Tensor, gen: torch.Generator) -> Message:
        v = v.detach().reshape(-1).float().cpu()
        n, d, s = v.numel(), self._bucket(v.numel()), self.levels
        padded = torch.zeros(-(-n // d) * d)
        padded[:n] = v
        buckets = padded.view(-1, d)
        norms = buckets.double().norm(dim=1).float()
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        r = (buckets.abs() / safe[:, None] * s).clamp(max=s)
        low = r.floor()
        up = torch.rand(buckets.shape, generator=gen) < (r - low)
        level = (low + up.float()).reshape(-1)[:n].to(torch.int64)
        negative = (v < 0).to(torch.int64)
        code = (negative << (self.bits - 1)) | level  # sign bit, then the level
        return Message(self.name, n, {"norms": norms.numpy().astype(np.float32),
                                      "codes": pack_bits(code.numpy(), self.bits)})

    def decode(self, m: Message, gen: torch.Generator | None = None) -> torch.Tensor:
        code = torch.from_numpy(unpack_bits(m.parts["codes"], self.bits, m.n))
        level = (code & (2 ** (self.bits - 1) - 1)).float()
        sign = 1.0 - 2.0 * (code >> (self.bits - 1)).float()
        norms = torch.from_numpy(m.parts["norms"].copy()).repeat_interleave(self._bucket(m.n))[:m.n]
        return norms * sign * level / self.levels


class ScaledSign:
    """Sign bits and the mean magnitude: of the whole vector (`blocks` None), or of each block
    of consecutive entries (`blocks`: their lengths, one per parameter tensor: the
    per-tensor scale of epfml/error-feedback-SGD, whose optimiser compresses tensor by tensor)."""

    name = "sign"

    def __init__(self, blocks: list[int] | None = None):
        self.blocks = list(blocks) if blocks else None

    def _blocks(self, n: int) -> list[int]:
        return self.blocks if self.blocks and sum(self.blocks) == n else [n]

    def encode(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Message:
        v = v.detach().reshape(-1).float().cpu()
        scale = torch.stack([part.double().abs().mean() if part.numel() else torch.zeros((), dtype=torch.float64)
                             for part in torch.split(v, self._blocks(v.numel()))]).float()
        return Message(self.name, v.numel(), {"scale": scale.numpy().astype(np.float32),
                                              "signs": np.packbits((v < 0).numpy().astype(np.uint8))})

    def signs(self, m: Message) -> torch.Tensor:
        """+1 / -1 per entry (0 encodes as +1)."""
        neg = np.unpackbits(m.parts["signs"])[:m.n].astype(np.float32)
        return torch.from_numpy(1.0 - 2.0 * neg)

    def decode(self, m: Message, gen: torch.Generator | None = None) -> torch.Tensor:
        scale = torch.from_numpy(m.parts["scale"].copy())
        sizes = self._blocks(m.n) if len(scale) > 1 else [m.n]
        return self.signs(m) * torch.repeat_interleave(scale, torch.tensor(sizes))
