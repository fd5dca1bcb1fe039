"""Issue 57's codecs by hand on small tensors: top-k keeps the k largest magnitudes, rand-k's
two ends draw the same indices, QSGD is unbiased over many draws, the encoded byte count is
the bit-packed message's length, and error feedback's residual carries exactly what was
dropped."""
import math

import numpy as np
import pytest
import torch

from raysim.compression.codecs import QSGD, RandK, ScaledSign, TopK, pack_bits, unpack_bits
from raysim.compression.error_feedback import encode_with_feedback


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("width", [1, 3, 7, 8, 13, 22])
def test_bit_packing_round_trips_and_takes_ceil_n_times_width_over_8_bytes(width):
    values = np.random.default_rng(width).integers(0, 2 ** width, size=37)
    packed = pack_bits(values, width)
    assert packed.nbytes == math.ceil(37 * width / 8)
    assert np.array_equal(unpack_bits(packed, width, 37), values)


def test_topk_keeps_the_k_largest_magnitudes_and_sends_indices_and_values():
    v = torch.tensor([0.1, -3.0, 0.5, 2.0, -0.2, 3.0, 0.0, 1.0, -1.5, 0.3])
    m = TopK(0.3).encode(v)  # k = 3 of 10: |-3| and |3| tie, then 2.0
    assert m.nbytes == math.ceil(3 * 4 / 8) + 3 * 4  # 4-bit indices into 10, float32 values
    assert TopK(0.3).decode(m).tolist() == [0, -3.0, 0, 2.0, 0, 3.0, 0, 0, 0, 0]
    tie = TopK(0.1).decode(TopK(0.1).encode(torch.tensor([1.0, -2.0, 2.0, 0.5])))
    assert tie.tolist() == [0, -2.0, 0, 0]  # a tie goes to the lower index


def test_randk_both_ends_draw_the_same_indices_and_only_values_travel():
    v = torch.arange(1.0, 21.0)
    c = RandK(0.25)
    m = c.encode(v, gen(7))
    assert m.nbytes == 5 * 4 and set(m.parts) == {"values"}
    out = c.decode(m, gen(7))
    kept = out.nonzero().reshape(-1)
    assert len(kept) == 5 and torch.equal(out[kept], v[kept])
    assert torch.equal(RandK(0.25, unbiased=True).decode(m, gen(7))[kept], v[kept] * 4)
    assert not torch.equal(c.decode(m, gen(8)), out)  # another stream: other indices


def test_qsgd_is_unbiased_over_many_draws_and_its_bytes_are_norms_plus_packed_codes():
    v = torch.tensor([0.9, -0.4, 0.05, 0.0, -1.3, 0.7, 0.2])
    c = QSGD(bits=3, bucket=4)  # 3 levels above zero; two buckets
    g = gen(0)
    draws = torch.stack([c.decode(c.encode(v, g)) for _ in range(20000)])
    assert torch.allclose(draws.mean(0), v, atol=0.01)
    m = c.encode(v, gen(1))
    assert m.nbytes == 2 * 4 + math.ceil(7 * 3 / 8)
    one = c.decode(m)
    norms = [float(torch.tensor([0.9, -0.4, 0.05, 0.0]).norm()), float(torch.tensor([-1.3, 0.7, 0.2]).norm())]
    for i, x in enumerate(one.tolist()):  # each entry: its bucket's norm x sign x l / 3, l one of the two nearest
        r = abs(v[i].item()) / norms[i // 4] * 3
        assert round(abs(x) / norms[i // 4] * 3, 4) in (math.floor(r), min(3, math.floor(r) + 1))
        assert x == 0 or (x < 0) == (v[i].item() < 0)
    assert torch.equal(c.decode(c.encode(v, gen(5))), c.decode(c.encode(v, gen(5))))  # one stream, one message


def test_scaled_sign_sends_one_bit_an_entry_and_the_mean_magnitude():
    v = torch.tensor([0.5, -1.5, 2.0, -0.0, 1.0])
    c = ScaledSign()
    m = c.encode(v)
    assert m.nbytes == 1 + 4
    assert c.decode(m).tolist() == [1.0, -1.0, 1.0, 1.0, 1.0]  # mean |v| = 1.0; -0.0 encodes as +1
    assert c.signs(m).tolist() == [1.0, -1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("codec", [TopK(0.2), RandK(0.2), QSGD(bits=2, bucket=8), ScaledSign()],
                         ids=["topk", "randk", "qsgd", "sign"])
def test_error_feedback_carries_exactly_what_each_message_dropped(codec):
    g = gen(3)
    updates = [torch.randn(25, generator=g) for _ in range(6)]
    residual, decoded = None, torch.zeros(25)
    stream = gen(11)
    for v in updates:
        before = stream.get_state()
        m, new = encode_with_feedback(codec, v, residual, stream)
        replay = torch.Generator()
        replay.set_state(before)
        d = codec.decode(m, replay)
        assert torch.equal(new, (v if residual is None else v + residual) - d)
        residual, decoded = new, decoded + d
    assert torch.allclose(decoded + residual, torch.stack(updates).sum(0), atol=1e-5)
