"""Hardening, part 4 (issue 55), through the real CLI: runs that cannot learn say so, and the
checks that need no data answer before Ray starts.

Covered elsewhere: an asynchronous run that cannot progress (`algorithm=fedbuff` with every
client dropping out: tests/test_async.py, `..._that_cannot_progress_...`); FedPer without
local test splits (tests/test_personal.py, `test_a_personalised_run_tests_its_clients_own_
models_unless_told_otherwise`); a device trace without bandwidth and an availability trace
whose intervals overlap (tests/test_clock.py's malformed-trace cases)."""
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from raysim.run import main

SMALL = ["dataset=digits", "model=mclr", "num_clients=6", "local.epochs=1"]


def one_line(code: int, err: str, expected_code: int = 2) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("raysim [")]
    assert code == expected_code and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "Traceback" not in err
    return lines[0]


def without_ray(args: list, tmp_path) -> str:
    """The command in a process where Ray cannot start (its temp folder under a file): an
    error it prints was found before Ray was asked to start."""
    (tmp_path / "a-file").write_text("")
    env = dict(os.environ, RAY_TMPDIR=str(tmp_path / "a-file" / "ray"))
    r = subprocess.run([sys.executable, "-m", "raysim.run", *args, f"output_dir={tmp_path / 'runs'}"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    line = one_line(r.returncode, r.stderr)
    assert not (tmp_path / "runs").exists()
    return line


def test_fine_tuning_without_local_test_splits_is_refused_before_ray_starts(tmp_path):
    line = without_ray(["eval.finetune_epochs=1"], tmp_path)
    assert "eval.finetune_epochs" in line and "set partition.test_fraction" in line, line


@pytest.mark.parametrize("folder, says", [("/proc/nope", "cannot create folders in /proc"),
                                          ("{tmp}/a-file/arrays", "a-file is a file, not a folder")])
def test_a_data_store_dir_that_cannot_be_written_is_refused_before_ray_starts(tmp_path, folder, says):
    line = without_ray(["data_store=files", f"data_store_dir={folder.format(tmp=tmp_path)}"], tmp_path)
    assert line.startswith(f"error: data_store_dir='{folder.format(tmp=tmp_path)}'") and says in line, line
    # data_store=auto with that folder named: refused too (the arrays may go there); memory: not read
    line = without_ray(["data_store=auto", f"data_store_dir={folder.format(tmp=tmp_path)}"], tmp_path)
    assert says in line, line


def test_a_deadline_no_client_can_meet_is_one_line_naming_the_fastest_client(ray_local, tmp_path, capfd):
    """The issue's case, `system.profile=mobile system.deadline=0.0001`, was a finished run at
    the untrained model's accuracy. The fastest client's seconds in the message are the
    clock's own for that client (the one the run would have computed)."""
    code = main(["system.profile=mobile", "system.deadline=0.0001", "rounds=3", f"output_dir={tmp_path / 'runs'}",
                 "--quiet"])
    line = one_line(code, capfd.readouterr().err)
    assert "system.deadline=0.0001: no client can send an update back in time; the fastest" in line, line
    assert not (tmp_path / "runs").exists()
    seconds = float(line.split("needs ")[1].split(" simulated")[0])
    # just above it, the run goes: the fastest client's updates arrive
    assert main(["system.profile=mobile", f"system.deadline={seconds * 1.01}", "rounds=2",
                 f"output_dir={tmp_path / 'runs'}", "run_name=ok", "--quiet"]) == 0
    calls = [c for c in pq.read_table(tmp_path / "runs" / "ok" / "clients.parquet").to_pylist()
             if c["method"] == "client_update"]
    assert min(c["sim_seconds"] for c in calls) == pytest.approx(seconds, rel=2e-3)


def test_a_round_whose_clients_all_miss_the_deadline_says_so(ray_local, tmp_path, capfd):
    """Devices from a trace: even clients fast, odd ones 10^8 times slower (~10^3 s an update), one client a round,
    a deadline only the fast ones meet. A round that picked an odd client has no update: a
    line in log.txt for each such round, `dropped=all` on the progress line, one `warning:`
    on stderr for the run, the count in summary.json and after the final accuracy."""
    (tmp_path / "devices.csv").write_text("gflops,down_mbps,up_mbps,latency_s\n100,100,100,0.01\n0.000001,100,100,0.01\n")
    args = [*SMALL, "clients_per_round=1", "rounds=8", "system.profile=trace", f"system.trace={tmp_path / 'devices.csv'}",
            "system.deadline=5", f"output_dir={tmp_path}", "run_name=r"]
    assert main(args) == 0
    out = capfd.readouterr()
    rows = pq.read_table(tmp_path / "r" / "metrics.parquet").to_pylist()
    empty = [r["round"] for r in rows if r["selected"][0] % 2 == 1]
    assert empty and len(empty) < len(rows), [r["selected"] for r in rows]  # seed 0: some of each kind
    assert all(r["dropped"] == r["clients"] == 1 for r in rows if r["round"] in empty)
    log = (tmp_path / "r" / "log.txt").read_text()
    for rnd in range(1, 9):
        said = f"round {rnd}: no update arrived: all 1 selected clients were dropped (1 deadline)" in log
        assert said == (rnd in empty), (rnd, empty)
    warnings = [line for line in out.err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and f"round {empty[0]}: no update arrived" in warnings[0], out.err
    assert "dropped=all" in out.err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["rounds_without_updates"] == len(empty)
    assert f"note: {len(empty)} of 8 rounds had no update" in out.out


@pytest.mark.parametrize("algorithm, nothing", [("fedper", "nothing would be shared"),
                                                ("lg_fedavg", "nothing would be kept")])
def test_a_personalised_method_on_a_model_without_an_encoder_is_refused(ray_local, tmp_path, capfd, algorithm,
                                                                         nothing):
    """mclr's encoder only flattens: FedPer would share nothing (each client trains alone,
    and the server's model is its random initial one), LG-FedAvg keep nothing (FedAvg)."""
    code = main([f"algorithm={algorithm}", "model=mclr", "rounds=2", f"output_dir={tmp_path / 'runs'}", "--quiet"])
    line = one_line(code, capfd.readouterr().err)
    assert f"algorithm={algorithm}" in line and "model='mclr' has no encoder weights" in line and nothing in line, line
    listed = line.split("that fit dataset 'digits': ")[1].split(", ")
    assert "mlp" in listed and "mclr" not in listed, line
    assert not (tmp_path / "runs").exists()


def test_a_round_with_fewer_clients_online_than_asked_warns_once_and_counts_them(ray_local, tmp_path, capfd):
    """Of 6 clients only 0 and 3 (trace client 0) are ever online in the first 10^8 s; 4 are
    asked for each round: each round trains the 2 online, its row says 2 were available, and
    one warning says so for the run."""
    (tmp_path / "on.csv").write_text("client,start_s,end_s\n0,0,100000000\n1,100000000,200000000\n"
                                     "2,100000000,200000000\n")
    assert main([*SMALL, "clients_per_round=4", "rounds=3", "system.profile=uniform", "system.availability=trace",
                 f"system.availability_trace={tmp_path / 'on.csv'}", f"output_dir={tmp_path}", "run_name=r",
                 "--quiet"]) == 0
    err = capfd.readouterr().err
    rows = pq.read_table(tmp_path / "r" / "metrics.parquet").to_pylist()
    assert [r["available"] for r in rows] == [2, 2, 2] and [r["clients"] for r in rows] == [2, 2, 2]
    assert all(sorted(r["selected"]) == [0, 3] for r in rows)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: round 1: 2 clients online, fewer than clients_per_round=4: the round trains those; "
                        "metrics.parquet's `available` has each round's count (said once)"], err
    assert "warning: round 1: 2 clients online" in (tmp_path / "r" / "log.txt").read_text()


def _write_rows(path, header: str, columns: list) -> None:
    with open(path, "w") as f:
        f.write(header + "\n")
        for block in range(0, len(columns[0]), 100_000):
            f.write("\n".join(",".join(cells) for cells in zip(*(c[block:block + 100_000] for c in columns))) + "\n")


def test_traces_of_a_million_rows_are_read_in_bounded_memory_and_a_run_takes_them(ray_local, tmp_path):
    """A device trace and an availability trace of 10^6 rows each (FedScale's traces have
    10^5-10^6 clients). Read in a fresh process, each adds less than 300 MB to its peak
    memory (the former row-by-row reader: ~500 and ~650 MB for these files), and a run with
    both ends normally, client c taking device row c and trace client c's intervals."""
    n = 1_000_000
    rng = np.random.default_rng(0)
    gflops = rng.uniform(1, 5, n)
    _write_rows(tmp_path / "devices.csv", "gflops,down_mbps,up_mbps,latency_s",
                [[f"{g:.3f}" for g in gflops], ["20"] * n, ["5"] * n, ["0.05"] * n])
    clients = np.repeat(np.arange(n // 100), 100)  # 10^4 clients, 100 intervals each, in the file's order
    k = np.tile(np.arange(100), n // 100)
    _write_rows(tmp_path / "online.csv", "client,start_s,end_s",
                [clients.astype(str).tolist(), (k * 1000).astype(str).tolist(), (k * 1000 + 900).astype(str).tolist()])
    probe = ("import resource, sys; from raysim.world import traces; "
             "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
             "out = getattr(traces, sys.argv[1])(sys.argv[2]); "
             "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)")
    for reader, path in (("read_devices", "devices.csv"), ("read_intervals", "online.csv")):
        r = subprocess.run([sys.executable, "-c", f"import numpy, pyarrow, pyarrow.csv; {probe}", reader,
                            str(tmp_path / path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert float(r.stdout) < 300, (reader, r.stdout)
    from raysim.world.traces import read_devices, read_intervals

    spans = read_intervals(str(tmp_path / "online.csv"))
    assert len(spans) == n // 100 and spans.period == 99_900.0
    assert spans.around(7, 3_500.0) == 3_900.0 and spans.around(7, 3_950.0) is None and spans.around(7, 3_500.0, 3_000.0) == 3_900.0
    assert read_devices(str(tmp_path / "devices.csv"))["speed"][:3] == pytest.approx(gflops[:3].round(3) * 1e9)
    assert main([*SMALL, "rounds=2", "system.profile=trace", f"system.trace={tmp_path / 'devices.csv'}",
                 "system.availability=trace", f"system.availability_trace={tmp_path / 'online.csv'}",
                 f"output_dir={tmp_path}", "run_name=r", "--quiet"]) == 0
    calls = [c for c in pq.read_table(tmp_path / "r" / "clients.parquet").to_pylist() if c["method"] == "client_update"]
    assert calls and all(c["status"] == "ok" for c in calls)
