"""Asynchronous FL on the virtual clock (algorithms/fedbuff.py, fedasync.py,
runtime/asynchronous.py): the staleness weights against the papers' formulas, FedBuff's
buffer flushes on a three-client case worked out by hand, and runs bit-identical across 1
and 3 actors and across a resume."""
import math

import pyarrow.parquet as pq
import pytest
import torch

from raysim.run import main


def test_staleness_weights_are_the_papers():
    from raysim.algorithms._asynchronous import staleness_weight

    for tau in range(0, 12):
        assert staleness_weight("sqrt", tau) == pytest.approx(1 / math.sqrt(1 + tau))  # FedBuff, Sec. 4
        assert staleness_weight("poly", tau, a=0.5) == pytest.approx((tau + 1) ** -0.5)  # FedAsync, Sec. 5.2
        assert staleness_weight("hinge", tau, a=10, b=4) == pytest.approx(1.0 if tau <= 4 else 1 / (10 * (tau - 4) + 1))
        assert staleness_weight("constant", tau) == 1.0


def _model(path):
    return torch.load(path / "model.pt", weights_only=True)["global"]


def test_fedbuff_flushes_by_hand(ray_local, tmp_path):
    """Three clients, all training at once from t = 0 (concurrency 3), equal shards, compute
    only (links of 10^6 Mbit/s, no latency): speeds 1 : 0.4 : 0.1 give durations d, 2.5 d,
    10 d. Buffer K = 2. Round 1: client 0 arrives at d (version 0, staleness 0), starts again
    from version 0 (no flush yet), arrives at 2 d (staleness 0): flush, version 1, the round
    ends at 2 d. Round 2: client 0 starts at 2 d from version 1; client 1 arrives at 2.5 d
    (trained from version 0: staleness 1), restarts; client 0 arrives at 3 d (staleness 0):
    flush, the round ends at 3 d. Client 2 is still training."""
    (tmp_path / "devices.csv").write_text("gflops,down_mbps,up_mbps,latency_s\n"
                                          "0.001,1000000,1000000,0\n0.0004,1000000,1000000,0\n"
                                          "0.0001,1000000,1000000,0\n")
    assert main(["dataset=digits", "model=mclr", "num_clients=3", "partition=contiguous", "rounds=2",
                 "algorithm=fedbuff", "fedbuff.concurrency=3", "fedbuff.buffer=2", "system.profile=trace",
                 f"system.trace={tmp_path / 'devices.csv'}", f"output_dir={tmp_path}", "run_name=r", "--quiet"]) == 0
    rows = pq.read_table(tmp_path / "r" / "metrics.parquet").to_pylist()
    clients = [c for c in pq.read_table(tmp_path / "r" / "clients.parquet").to_pylist()
               if c["method"] == "client_update"]
    d = {c["cid"]: c["sim_seconds"] for c in clients}
    assert d[1] == pytest.approx(2.5 * d[0], rel=1e-3)  # equal shards: durations by speed
    assert [(c["round"], c["cid"]) for c in clients] == [(1, 0), (1, 0), (2, 1), (2, 0)]
    assert [(r["staleness_mean"], r["staleness_max"]) for r in rows] == [(0.0, 0), (0.5, 1)]
    assert rows[0]["sim_end"] == pytest.approx(2 * d[0], rel=1e-6)
    assert rows[1]["sim_start"] == rows[0]["sim_end"] and rows[1]["sim_end"] == pytest.approx(3 * d[0], rel=1e-6)


@pytest.mark.parametrize("algorithm", ["fedbuff", "fedasync"])
def test_async_runs_are_bit_identical_across_actors_and_resume_and_learn(ray_local, tmp_path, algorithm):
    """The same asynchronous run on 1 and 3 client actors, and stopped after round 4 then
    resumed to round 8 (the clients in flight at the checkpoint are sent again), gives the
    same model and simulated times, bit for bit; and it learns (digits, 20 clients, mobile
    devices)."""
    common = ["dataset=digits", "model=mclr", "num_clients=20", "local.lr=0.1", f"algorithm={algorithm}",
              f"{algorithm}.concurrency=6", "system.profile=mobile", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=8", "resources.num_actors=1", "run_name=one"]) == 0
    assert main([*common, "rounds=8", "resources.num_actors=3", "run_name=three"]) == 0
    assert main([*common, "rounds=4", "resources.num_actors=2", "checkpoint_every=4", "run_name=half"]) == 0
    assert torch.load(tmp_path / "half" / "checkpoint.pt", weights_only=False)["flight"]["flights"]  # in flight
    assert main(["--quiet", f"resume={tmp_path / 'half'}", "rounds=8"]) == 0
    one = _model(tmp_path / "one")
    for other in ("three", "half"):
        m = _model(tmp_path / other)
        assert all(torch.equal(one[k], m[k]) for k in one), other
    rows = pq.read_table(tmp_path / "one" / "metrics.parquet").to_pylist()
    half = pq.read_table(tmp_path / "half" / "metrics.parquet").to_pylist()
    assert [r["sim_end"] for r in half] == [r["sim_end"] for r in rows]
    assert rows[-1]["accuracy"] > 0.6, rows[-1]  # from 0.1 (10 classes): it learns
    assert max(r["staleness_max"] for r in rows) >= 1  # updates did arrive stale
