"""Simulated time (raysim/world/clock.py, online.py): a three-client case computed by hand,
the deadline's drops, the rounds' and clients' simulated times in a real run, online
intervals by hand and respected by every selection strategy, and a malformed trace as one
line naming the file and the row."""
import json

import numpy as np
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
    from raysim.world.clock import Clock

    (tmp_path / "devices.csv").write_text(TRACE)
    cfg = load_config(overrides=["system.profile=trace", f"system.trace={tmp_path / 'devices.csv'}"])
    clock = Clock(cfg, 3, [10, 20, 30], 1e8)
    one = dict.fromkeys([0, 1, 2], 1)
    kept, lost, took = clock.call([0, 1, 2], one, 10**6)
    assert kept == [0, 1, 2] and lost == {} and took == pytest.approx({0: 3.2, 1: 2.7, 2: 8.2})
    assert clock.now == pytest.approx(8.2)
    clock.call([0, 1], {0: 2, 1: 1}, 10**6)  # two epochs: client 0 computes 2 s
    assert clock.now == pytest.approx(8.2 + 4.2)
    clock.deadline, clock.now = 5.0, 0.0
    kept, lost, took = clock.call([0, 1, 2], one, 10**6)
    assert kept == [0, 1] and lost == {2: "deadline"} and clock.now == pytest.approx(5.0)
    kept, lost, _ = clock.call([0, 1], one, 10**6)  # no one late: the slowest kept
    assert lost == {} and clock.now == pytest.approx(5.0 + 3.2)
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
    assert main([*common, f"system.deadline={deadline}", "run_name=dl"]) == 0
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
    # stopped after round 2, resumed to round 4: the same simulated times (the clock is checkpointed)
    assert main([*common, f"system.deadline={deadline}", "rounds=2", "run_name=half"]) == 0
    assert main(["--quiet", f"resume={tmp_path / 'half'}", "rounds=4"]) == 0
    again = pq.read_table(tmp_path / "half" / "metrics.parquet").to_pylist()
    assert [(r["sim_start"], r["sim_end"]) for r in again] == [(r["sim_start"], r["sim_end"]) for r in rows]


@pytest.mark.parametrize("text, says", [
    ("gflops,down,up,latency\n1,2,3,4\n", "the first row must be the header gflops,down_mbps,up_mbps,latency_s"),
    (TRACE + "1,8,x,0.1\n", "row 5: '1,8,x,0.1' is not gflops,down_mbps,up_mbps,latency_s"),
    (TRACE + "0,8,8,0.1\n", "row 5: '0,8,8,0.1' is not gflops,down_mbps,up_mbps,latency_s"),
    (TRACE + "1,8\n", "row 5: '1,8' is not"),
    (TRACE + "1,8,inf,0.1\n", "row 5: '1,8,inf,0.1' is not"),
    # every device without bandwidth: no client could ever finish an update
    ("gflops,down_mbps,up_mbps,latency_s\n" + "2,0,0,0.1\n" * 3, "row 2: '2,0,0,0.1' is not gflops,down_mbps,"
                                                                "up_mbps,latency_s (gflops, down_mbps and up_mbps > 0: "
                                                                "a device without compute or bandwidth never finishes"),
])
def test_a_malformed_trace_is_one_line_naming_the_file_and_the_row(ray_local, tmp_path, capfd, text, says):
    (tmp_path / "devices.csv").write_text(text)
    assert main(["system.profile=trace", f"system.trace={tmp_path / 'devices.csv'}", f"output_dir={tmp_path / 'runs'}",
                 "--quiet"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"system.trace={tmp_path / 'devices.csv'}" in err[0] and says in err[0], err
    assert not (tmp_path / "runs").exists()


def test_online_intervals_by_hand(tmp_path):
    """A trace of two clients (client 0: [0, 10) and [20, 30); client 1: [5, 40)) repeats
    every 40 s; client 2 follows trace client 0. `diurnal` gives each client one stretch of
    `online_hours` a day."""
    from raysim.world.online import Online

    (tmp_path / "on.csv").write_text("client,start_s,end_s\n0,20,30\n0,0,10\n1,5,40\n")
    cfg = load_config(overrides=["system.profile=uniform", "system.availability=trace",
                                 f"system.availability_trace={tmp_path / 'on.csv'}"])
    on = Online(cfg, 3)
    assert on.online([0, 1, 2], 3.0) == [0, 2] and on.online([0, 1, 2], 12.0) == [1]
    assert on.until(0, 25.0) == 30.0 and on.until(0, 15.0) is None and on.until(1, 6.0) == 40.0
    assert on.online([0, 1, 2], 43.0) == [0, 2] and on.until(0, 65.0) == 70.0  # repeated: period 40 s
    assert on.next_start([0], 12.0) == 20.0 and on.next_start([1], 41.0) == 45.0
    cfg = load_config(overrides=["system.profile=uniform", "system.availability=diurnal", "system.online_hours=6"])
    day = Online(cfg, 50)
    share = np.mean([len(day.online(list(range(50)), t * 3600.0)) / 50 for t in range(0, 96)])
    assert abs(share - 6 / 24) < 0.08  # online a quarter of the time, on average
    for c in range(50):
        starts = [t for t in np.arange(0, 2 * 86400, 600.0) if day.until(c, t) is not None]
        assert 5.8 * 3600 <= len(starts) * 600 / 2 <= 6.2 * 3600  # 6 hours a day each


@pytest.mark.parametrize("selection", ["random", "fedentopt", "kl"])
def test_every_selection_strategy_sees_only_online_clients(ray_local, tmp_path, selection):
    """Clients 0-4 are online from the start, 5-9 only after 10^8 s: every strategy picks
    from 0-4, and a client whose online time ends mid-update (client 4, online for 0.05 s) is
    dropped as `offline` (a round takes ~0.1 s: two 50 ms latencies)."""
    from raysim.registry import SELECTIONS

    shipped = sorted(n for n in SELECTIONS.names() if not n.startswith("test_"))  # not the tests' plugins'
    assert shipped == ["fedentopt", "kl", "random"]  # a new strategy: add it above
    rows = ["client,start_s,end_s"] + [f"{c},0,100000000" for c in range(4)] + ["4,0,0.05"] + \
        [f"{c},100000000,200000000" for c in range(5, 10)]
    (tmp_path / "on.csv").write_text("\n".join(rows) + "\n")
    assert main(["dataset=digits", "model=mclr", "num_clients=10", "clients_per_round=3", "rounds=3",
                 f"selection={selection}", "system.profile=uniform", "system.availability=trace",
                 f"system.availability_trace={tmp_path / 'on.csv'}", f"output_dir={tmp_path}", "run_name=r",
                 "--quiet"]) == 0
    calls = [c for c in pq.read_table(tmp_path / "r" / "clients.parquet").to_pylist() if c["method"] == "client_update"]
    assert calls and {c["cid"] for c in calls} <= {0, 1, 2, 3, 4}
    assert all(c["reason"] == "offline" for c in calls if c["cid"] == 4)
    metrics = pq.read_table(tmp_path / "r" / "metrics.parquet").to_pylist()
    assert all(r["available"] <= 5 for r in metrics)


@pytest.mark.parametrize("text, says", [
    ("client,start_s,end_s\n0,0,10\n1,20,5\n", "row 3: '1,20,5' is not client,start_s,end_s"),
    ("client,start_s,end_s\n0,0,10\n0,5,20\n", "client 0's intervals overlap"),
])
def test_a_malformed_availability_trace_is_one_line(ray_local, tmp_path, capfd, text, says):
    (tmp_path / "on.csv").write_text(text)
    assert main(["system.profile=uniform", "system.availability=trace", f"system.availability_trace={tmp_path / 'on.csv'}",
                 f"output_dir={tmp_path / 'runs'}", "--quiet"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"system.availability_trace={tmp_path / 'on.csv'}" in err[0] and says in err[0], err
    assert not (tmp_path / "runs").exists()
