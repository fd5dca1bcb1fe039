"""Issue 57's codecs by hand on small tensors: top-k keeps the k largest magnitudes, rand-k's
two ends draw the same indices, QSGD is unbiased over many draws, the encoded byte count is
the bit-packed message's length, and error feedback's residual carries exactly what was
dropped. Then `compress.up` on the platform: a client's update encoded and decoded around a
model with a buffer, signSGD's majority vote by hand, the refused combinations in one line
each, and real runs: the bytes counted are the messages', the clock's upload time follows
them, and the models are bit-identical across actor counts and a resume (the residuals are
checkpointed client state)."""
import json
import math

import numpy as np
import pytest
import torch

from raysim.compression.codecs import QSGD, RandK, ScaledSign, TopK, pack_bits, unpack_bits
from raysim.compression.error_feedback import encode_with_feedback
from raysim.config import ConfigError, load_config


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


def test_scaled_sign_per_tensor_scales_each_tensor_by_its_own_mean_magnitude():
    """`compress.sign_scale=tensor` (epfml/error-feedback-SGD's per-parameter scaled sign): a
    tensor of 2 entries (0.5, -1.5: mean 1) and one of 3 (2, -4, 0: mean 2), one float32 each."""
    from raysim.compression.uplink import Uplink

    v = torch.tensor([0.5, -1.5, 2.0, -4.0, 0.0])
    c = ScaledSign([2, 3])
    m = c.encode(v)
    assert m.nbytes == 1 + 2 * 4
    assert c.decode(m).tolist() == [1.0, -1.0, 2.0, -2.0, 2.0]
    assert torch.allclose(ScaledSign().decode(ScaledSign().encode(v)), torch.tensor([1.6, -1.6, 1.6, -1.6, 1.6]))
    model = torch.nn.Linear(3, 2)  # bias (2 entries) then weight (6), sorted by name
    uplink = Uplink.from_config(load_config(overrides=["compress.up=sign", "compress.sign_scale=tensor"]), model)
    assert uplink.codec.blocks == [2, 6]


@pytest.mark.parametrize("codec", [TopK(0.2), RandK(0.2), QSGD(bits=2, bucket=8), ScaledSign()],
                         ids=["topk", "randk", "qsgd", "sign"])
def test_error_feedback_loses_nothing_over_rounds(codec):
    """Over six updates the decoded messages plus the last residual add up to the updates
    sent: what a message dropped is only delayed."""
    g = gen(3)
    updates = [torch.randn(25, generator=g) for _ in range(6)]
    residual, decoded = None, torch.zeros(25)
    stream = gen(11)
    for v in updates:
        before = stream.get_state()
        m, residual = encode_with_feedback(codec, v, residual, stream)
        replay = torch.Generator()
        replay.set_state(before)
        decoded += codec.decode(m, replay)
    assert torch.allclose(decoded + residual, torch.stack(updates).sum(0), atol=1e-5)


def test_top_k_error_feedback_by_hand():
    """Top-2 of 4 entries. Round 1: v = (3, -1, 0.5, 2) sends entries 0 and 3, keeps
    (0, -1, 0.5, 0). Round 2: v = (0, 1, 1, 0.25): v + e = (0, 0, 1.5, 0.25) sends entries 2
    and 3 (1.5, 0.25), keeps 0 (entry 1's -1 + 1 cancelled)."""
    m, e = encode_with_feedback(TopK(0.5), torch.tensor([3.0, -1.0, 0.5, 2.0]), None, None)
    assert TopK(0.5).decode(m).tolist() == [3.0, 0.0, 0.0, 2.0] and e.tolist() == [0.0, -1.0, 0.5, 0.0]
    m, e = encode_with_feedback(TopK(0.5), torch.tensor([0.0, 1.0, 1.0, 0.25]), e, None)
    assert TopK(0.5).decode(m).tolist() == [0.0, 0.0, 1.5, 0.25] and e.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_signsgd_error_feedback_keeps_the_residual_against_the_servers_step():
    """signSGD sends bare signs and the server steps server.lr = 1e-3 along them. A client
    whose update is +1e-3 every round must send +1 every round: its residual is
    (v + e) - lr x sign(v + e) = 0 (epfml/error-feedback-SGD's scaling). Kept against the
    decoded +-1 instead (issue 71), the residual was ~ -1 and the signs alternated +1, -1.
    A mixed update: what the server applied (lr x the signs) plus the residual is what was sent."""
    from raysim.compression.uplink import codec_of

    codec = codec_of(load_config(overrides=["compress.up=signsgd", "server.aggregator=majority_vote",
                                            "server.lr=0.001", "compress.error_feedback=true"]))
    residual, signs = None, []
    for _ in range(6):
        m, residual = encode_with_feedback(codec, torch.full((5,), 1e-3), residual, None)
        signs.append(codec.decode(m).tolist())
    assert signs == [[1.0] * 5] * 6 and torch.allclose(residual, torch.zeros(5), atol=1e-9)
    g, residual, applied = gen(5), None, torch.zeros(40)
    updates = [torch.randn(40, generator=g) * 1e-3 for _ in range(8)]
    for v in updates:
        m, residual = encode_with_feedback(codec, v, residual, None)
        applied += 1e-3 * codec.decode(m)
        assert residual.abs().max() < 5e-3  # of the updates' order, not of the signs' (1)
    assert torch.allclose(applied + residual, torch.stack(updates).sum(0), atol=1e-6)


def _model_with_a_buffer():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


@pytest.mark.parametrize("up", ["topk", "qsgd", "sign"])
def test_a_clients_update_is_sent_encoded_and_the_server_gets_the_weights_plus_its_decoding(up):
    """The update is trained - sent over the trainable parameters (sorted names, one vector);
    the BatchNorm statistics travel raw; the bytes are the message's plus the raw entries'."""
    from types import SimpleNamespace

    from raysim.compression.uplink import Compressed, Uplink, codec_of
    from raysim.contract import ClientResult
    from raysim.training import nbytes

    reads = {"topk": ["compress.ratio=0.25"], "randk": ["compress.ratio=0.25"],
             "qsgd": ["compress.bits=4", "compress.bucket=8"]}  # a key the codec does not read is refused
    cfg = load_config(overrides=[f"compress.up={up}", *reads.get(up, [])])
    model = _model_with_a_buffer()
    sent = {k: v.clone() for k, v in model.state_dict().items()}
    trained = {k: v + torch.randn(v.shape) if v.is_floating_point() else v + 1 for k, v in sent.items()}
    uplink = Uplink.from_config(cfg, model)
    keys = sorted(k for k, _ in model.named_parameters())
    assert uplink.keys == keys
    client = SimpleNamespace(cid=3, state={})
    result = uplink.send(client, {"weights": sent}, ClientResult(3, 10, dict(trained)), rnd=2)
    assert isinstance(result.update, Compressed) and sorted(result.update.rest) == sorted(set(sent) - set(keys))
    v = torch.cat([(trained[k] - sent[k]).reshape(-1) for k in keys])
    assert result.update.message.n == v.numel() == 29
    assert nbytes(result.update) == result.update.message.nbytes + sum(nbytes(sent[k]) for k in result.update.rest)
    assert nbytes(result.update) == uplink.message_bytes(sent) < nbytes(sent)
    got = uplink.receive(result.update, {"weights": sent}, 2, 3)
    assert all(torch.equal(got[k], trained[k]) for k in sent if k not in keys)  # buffers as trained
    assert list(got) == list(sent)
    moved = torch.cat([(got[k] - sent[k]).reshape(-1) for k in keys])  # what the server got, against v by hand
    if up == "topk":  # the 8 largest |update| entries come back, the rest as the weights sent
        top = torch.zeros(29)
        at = v.abs().topk(math.ceil(0.25 * 29)).indices
        top[at] = v[at]
        assert torch.allclose(moved, top, atol=1e-6)
    elif up == "sign":  # the mean magnitude times each sign
        assert torch.allclose(moved, v.abs().mean() * torch.where(v < 0, -1.0, 1.0), atol=1e-6)
    else:  # qsgd, 4 bits: per bucket of 8, |entry| = norm x l / 7 with l one of the two levels around 7 |v| / norm
        norms = torch.cat([v[i:i + 8].norm().expand(len(v[i:i + 8])) for i in range(0, 29, 8)])
        level = moved.abs() / norms * 7
        assert torch.allclose(level, level.round(), atol=1e-4)
        assert torch.isin(level.round() - (7 * v.abs() / norms).floor(), torch.tensor([0.0, 1.0])).all()
        assert ((moved == 0) | (torch.sign(moved) == torch.sign(v))).all()


def test_error_feedback_keeps_its_residual_as_client_state_out_of_the_algorithms_sight():
    from types import SimpleNamespace

    from raysim.compression.uplink import RESIDUAL, Uplink
    from raysim.contract import ClientResult

    cfg = load_config(overrides=["compress.up=topk", "compress.ratio=0.1", "compress.error_feedback=true"])
    model = _model_with_a_buffer()
    sent = {k: v.clone() for k, v in model.state_dict().items()}
    uplink = Uplink.from_config(cfg, model)
    client = SimpleNamespace(cid=0, state={})
    total = torch.zeros(29)
    for rnd in (1, 2, 3):
        trained = {k: v + 0.1 * rnd if v.is_floating_point() else v for k, v in sent.items()}
        residual = uplink.hide(client)
        assert RESIDUAL not in client.state and (residual is None) == (rnd == 1)
        result = uplink.send(client, {"weights": sent}, ClientResult(0, 5, trained), rnd, residual)
        got = uplink.receive(result.update, {"weights": sent}, rnd, 0)
        total += torch.cat([(got[k] - sent[k]).reshape(-1) for k in uplink.keys])
    sent_total = sum(0.1 * r for r in (1, 2, 3))
    assert torch.allclose(total + client.state[RESIDUAL], torch.full((29,), sent_total), atol=1e-5)


def test_majority_vote_steps_along_the_sign_of_the_clients_signs():
    from raysim.aggregation.aggregators import MajorityVote

    cfg = load_config(overrides=[])
    vote = MajorityVote(cfg.server)
    x = torch.tensor([1.0, 1.0, 1.0, 1.0])
    for delta in ([5.0, -1.0, 1.0, 0.0], [0.1, -2.0, -1.0, 0.0], [0.2, 3.0, -0.5, 0.0]):
        vote.add({"w": x + torch.tensor(delta)}, weight=100.0)  # weights do not count
    # signs: (+,+,+) -> +1; (-,-,+) -> -1; (+,-,-) -> -1; (0,0,0) -> 0
    assert vote.result({"w": x})["w"].tolist() == [2.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("overrides, says", [
    (["compress.up=gzip"], "compress.up must be one of none, topk, randk, qsgd, sign, signsgd, got 'gzip'"),
    (["compress.up=topk", "compress.ratio=0"], "compress.ratio must be in (0, 1]"),
    (["compress.up=qsgd", "compress.bits=1"], "compress.bits must be in [2, 32]"),
    (["compress.error_feedback=true"], "compress.error_feedback needs a codec"),
    (["compress.up=topk", "algorithm=fedconcat"], "compress.up=topk encodes the update of a client that returns its model"),
    (["compress.up=topk", "server.partial_sums=2"], "server.partial_sums: compress.up=topk encodes each client's update alone"),
    (["compress.up=topk", "privacy.secure_aggregation=secagg"], "compress.up=topk with privacy.secure_aggregation"),
    (["compress.up=signsgd"], "compress.up=signsgd sends bare signs, which only server.aggregator=majority_vote reads"),
    (["compress.up=sign", "server.aggregator=majority_vote", "compress.error_feedback=true"],
     "compress.error_feedback with compress.up=sign and server.aggregator=majority_vote: the vote steps server.lr"),
    (["compress.up=signsgd", "server.aggregator=majority_vote", "compress.error_feedback=true",
      "server.optimizer=adam"], "keeps its residual against a step of server.lr x the sign"),
    (["compress.up=topk", "compress.error_feedback=true", "algorithm=fedasync"],
     "compress.error_feedback with algorithm=fedasync: a client in flight at a checkpoint"),
])
def test_a_combination_compression_cannot_take_is_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_vectorised_groups_are_compressed_per_client_not_summed():
    from raysim.config import sum_block

    cfg = load_config(overrides=["local.vectorize=true", "compress.up=qsgd"])
    assert sum_block(cfg) == 0 and sum_block(load_config(overrides=["local.vectorize=true"])) > 0


TRACE = "gflops,down_mbps,up_mbps,latency_s\n1,8,8,0.1\n2,16,4,0.1\n"


def test_a_compressed_run_counts_its_messages_bytes_and_the_clock_uploads_them(ray_local, tmp_path):
    """Top-1 %: each client's bytes_up is its message's length (k indices at ceil(log2 n)
    bits, bit-packed, and k float32 values; the MLP has no buffers), the rounds' bytes_up are
    their sum, and each client's simulated seconds are those of the same uncompressed run less
    (model bytes - message bytes) / its uplink (a trace: 1 or 0.5 MB/s)."""
    import pyarrow.parquet as pq

    from raysim.run import main

    (tmp_path / "devices.csv").write_text(TRACE)
    common = ["dataset=digits", "model=mlp", "num_clients=6", "participation=0.5", "rounds=2", "system.profile=trace",
              f"system.trace={tmp_path / 'devices.csv'}", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "run_name=plain"]) == 0
    assert main([*common, "compress.up=topk", "compress.ratio=0.01", "run_name=topk"]) == 0
    model = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)
    model = model.get("global", model)
    n = sum(v.numel() for v in model.values())
    k = math.ceil(0.01 * n)
    message = math.ceil(k * math.ceil(math.log2(n)) / 8) + 4 * k
    plain = {(r["round"], r["cid"]): r for r in pq.read_table(tmp_path / "plain" / "clients.parquet").to_pylist()}
    rows = pq.read_table(tmp_path / "topk" / "clients.parquet").to_pylist()
    assert rows and all(r["bytes_up"] == message for r in rows)
    up = {0: 1e6, 1: 0.5e6}
    for r in rows:
        assert r["sim_seconds"] == pytest.approx(plain[(r["round"], r["cid"])]["sim_seconds"] - (4 * n - message) / up[r["cid"] % 2])
    metrics = pq.read_table(tmp_path / "topk" / "metrics.parquet").to_pylist()
    for m in metrics:
        assert m["round_bytes_up"] == message * sum(1 for r in rows if r["round"] == m["round"])
    summary = json.loads((tmp_path / "topk" / "summary.json").read_text())
    assert summary["status"] == "finished"


def test_error_feedback_runs_are_bit_identical_across_actor_counts_and_a_resume(ray_local, tmp_path):
    from raysim.run import main

    common = ["dataset=digits", "model=mlp", "num_clients=8", "participation=0.5", "checkpoint_every=2",
              "compress.up=randk", "compress.ratio=0.05", "compress.error_feedback=true",
              f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=4", "resources.num_actors=1", "run_name=one"]) == 0
    assert main([*common, "rounds=4", "resources.num_actors=3", "run_name=three"]) == 0
    assert main([*common, "rounds=2", "resources.num_actors=2", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "--quiet"]) == 0
    a, b, c = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("one", "three", "part"))
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert main([*common[:5], f"output_dir={tmp_path}", "--quiet", "rounds=4", "run_name=plain"]) == 0
    d = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)["global"]
    assert not all(torch.equal(a[k], d[k]) for k in a)  # compression changed the model


def test_fedbuff_arrivals_upload_the_encoded_bytes_and_resume_bit_for_bit(ray_local, tmp_path):
    """FedBuff sends FedAvg's model (it refuses model attacks, not compression): with top-5 %
    each arrival's simulated seconds are the plain run's for that client less (model bytes -
    message bytes) / the uniform profile's 5 Mbit/s uplink, and a resumed run (its clients in
    flight trained again) is bit-identical to the whole one."""
    import pyarrow.parquet as pq

    from raysim.run import main

    common = ["dataset=digits", "model=mlp", "num_clients=10", "algorithm=fedbuff", "fedbuff.concurrency=4",
              "fedbuff.buffer=3", "checkpoint_every=2", f"output_dir={tmp_path}", "--quiet"]
    ef = ["compress.up=topk", "compress.ratio=0.05"]
    assert main([*common, "rounds=3", "run_name=plain"]) == 0
    assert main([*common, *ef, "rounds=4", "resources.num_actors=1", "run_name=one"]) == 0
    plain = {r["cid"]: r["sim_seconds"] for r in pq.read_table(tmp_path / "plain" / "clients.parquet").to_pylist()}
    rows = pq.read_table(tmp_path / "one" / "clients.parquet").to_pylist()
    model = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)["global"]
    n = sum(v.numel() for v in model.values())
    k = math.ceil(0.05 * n)
    message = math.ceil(k * math.ceil(math.log2(n)) / 8) + 4 * k
    assert rows and all(r["bytes_up"] == message for r in rows)
    both = [r for r in rows if r["cid"] in plain]
    assert both and all(r["sim_seconds"] == pytest.approx(plain[r["cid"]] - (4 * n - message) / 625_000) for r in both)
    assert main([*common, *ef, "rounds=2", "resources.num_actors=2", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "--quiet"]) == 0
    a, c = (torch.load(tmp_path / r / "model.pt", weights_only=True)["global"] for r in ("one", "part"))
    assert all(torch.equal(a[key], c[key]) for key in a)
