"""Simulated time (raysim/runtime/clock.py): a three-client case computed by hand, the
deadline's drops, the rounds' and clients' simulated times in a real run, and a malformed
device trace as one line naming the file and the row."""
import json

import pyarrow.parquet as pq
import pytest

from raysim.config import load_config
from raysim.run import main

TRACE = "gflops,down_mbps,up_mbps,latency_s\n1,8,8,0.1\n2,16,8,0.1\n0.5,8,8,0.1\n"


def test_three_clients_by_hand(tmp_path):
    """Devices from a trace (client c: row c): speed 1 / 2 / 0.5 GFLOP/s, 8 / 16 / 8 Mbit/s
    down (1 / 2 / 1 MB/s), 8 up, 0.1 s latency; 10 / 20 / 30 samples, 1e8 FLOPs a sample, a
    1 MB payload. Each client: 2 x 0.1 + 1 MB / down + samples x 1e8 / speed + 1 MB / 1 MB/s:
    3.2, 2.7 and 8.2 s. A call ends with its slowest client; a 5 s deadline drops client 2
    and ends the call at 5 s."""
    from raysim.runtime.clock import Clock

    (tmp_path / "devices.csv").write_text(TRACE)
    cfg = load_config(overrides=["system.profile=trace", f"system.trace={tmp_path / 'devices.csv'}"])
    clock = Clock(cfg, 3, [10, 20, 30], 1e8)
    one = dict.fromkeys([0, 1, 2], 1)
    kept, late, took = clock.call([0, 1, 2], one, 10**6)
    assert kept == [0, 1, 2] and late == [] and took == pytest.approx({0: 3.2, 1: 2.7, 2: 8.2})
    assert clock.now == pytest.approx(8.2)
    kept, late, _ = clock.call([0, 1], {0: 2, 1: 1}, 10**6)  # two epochs: client 0 computes 2 s
    assert clock.now == pytest.approx(8.2 + 4.2)
    clock.deadline, clock.now = 5.0, 0.0
    kept, late, took = clock.call([0, 1, 2], one, 10**6)
    assert kept == [0, 1] and late == [2] and clock.now == pytest.approx(5.0)
    kept, late, _ = clock.call([0, 1], one, 10**6)  # no one late: the slowest kept
    assert late == [] and clock.now == pytest.approx(5.0 + 3.2)
    # a client past the trace's rows takes row c mod 3
    assert Clock(cfg, 5, [10] * 5, 1e8).devices["speed"].tolist() == [1e9, 2e9, 5e8, 1e9, 2e9]


def test_a_run_records_simulated_time_and_the_deadline_drops_the_slow_clients(ray_local, tmp_path):
    """The `mobile` profile (devices drawn from the seed) with a deadline: every round's
    sim_end - sim_start is its slowest kept client's sim_seconds, or the deadline when one was
    dropped for it; the dropped ones are `reason=deadline` rows; summary.json has the run's
    simulated time and the time to the target accuracy; a resumed run has the same times."""
    common = ["dataset=digits", "model=mclr", "num_clients=10", "participation=0.6", "rounds=4", "local.lr=0.1",
              "system.profile=mobile", "system.target_accuracy=0.5", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "run_name=free"]) == 0
    free = pq.read_table(tmp_path / "free" / "clients.parquet").to_pylist()
    took = sorted(r["sim_seconds"] for r in free if r["method"] == "client_update")
    deadline = took[len(took) // 2]  # half the calls would be late
    assert main([*common, f"system.deadline={deadline}", "checkpoint_every=2", "run_name=dl"]) == 0
    rows = pq.read_table(tmp_path / "dl" / "metrics.parquet").to_pylist()
    clients = pq.read_table(tmp_path / "dl" / "clients.parquet").to_pylist()
    late = [c for c in clients if c["reason"] == "deadline"]
    assert late and all(c["sim_seconds"] > deadline for c in late)
    for r in rows:
        mine = [c for c in clients if c["round"] == r["round"] and c["method"] == "client_update"]
        kept = [c["sim_seconds"] for c in mine if c["status"] == "ok"]
        dropped = any(c["reason"] == "deadline" for c in mine)
        assert r["sim_end"] - r["sim_start"] == pytest.approx(deadline if dropped else max(kept))
        assert all(s <= deadline for s in kept)
    assert rows[0]["sim_start"] == 0 and all(a["sim_end"] == b["sim_start"] for a, b in zip(rows, rows[1:]))
    summary = json.loads((tmp_path / "dl" / "summary.json").read_text())
    assert summary["sim_seconds"] == pytest.approx(rows[-1]["sim_end"])
    reached = [r["sim_end"] for r in rows if r.get("accuracy") is not None and r["accuracy"] >= 0.5]
    assert summary["sim_seconds_to_target"] == (reached[0] if reached else None)
    # resumed from round 2's checkpoint: the same simulated times
    (tmp_path / "dl" / "summary.json").unlink()
    assert main(["--quiet", f"resume={tmp_path / 'dl'}"]) == 0
    again = pq.read_table(tmp_path / "dl" / "metrics.parquet").to_pylist()
    assert [(r["sim_start"], r["sim_end"]) for r in again] == [(r["sim_start"], r["sim_end"]) for r in rows]


@pytest.mark.parametrize("text, says", [
    ("gflops,down,up,latency\n1,2,3,4\n", "the first row must be the header gflops,down_mbps,up_mbps,latency_s"),
    (TRACE + "1,8,x,0.1\n", "row 5: '1,8,x,0.1' is not four numbers"),
    (TRACE + "0,8,8,0.1\n", "row 5: '0,8,8,0.1' is not four numbers"),
])
def test_a_malformed_trace_is_one_line_naming_the_file_and_the_row(tmp_path, capfd, text, says):
    (tmp_path / "devices.csv").write_text(text)
    assert main(["system.profile=trace", f"system.trace={tmp_path / 'devices.csv'}", f"output_dir={tmp_path / 'runs'}",
                 "--quiet"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"system.trace={tmp_path / 'devices.csv'}" in err[0] and says in err[0], err
    assert not (tmp_path / "runs").exists()
