"""The Ray runtime end to end: real local Ray, real client actors, real torch training."""
import json
import re

import pyarrow.parquet as pq
import pytest
import torch

from raysim.run import main
from saved_models import tensors  # tests/support

# digits + MLP: small enough for seconds per run, real enough to learn.
BASE = ["dataset=digits", "model=mlp", "num_clients=12", "rounds=3", "local.epochs=1", "local.batch_size=16",
        "eval_every=1", "--quiet"]


def run(tmp_path, name, *extra):
    assert main([*BASE, f"output_dir={tmp_path}", f"run_name={name}", *extra]) == 0
    d = tmp_path / name
    return d, json.loads((d / "summary.json").read_text())


def test_default_run_writes_a_complete_run_dir(ray_local, tmp_path):
    d, s = run(tmp_path, "basic", "rounds=8", "participation=0.5")
    for f in ("config.yaml", "log.txt", "metrics.parquet", "clients.parquet", "model.pt", "summary.json"):
        assert (d / f).is_file(), f
    assert s["rounds"] == 8 and s["client_updates"] == 8 * 6
    assert s["final_accuracy"] > 0.5  # 10 classes: chance is 0.1
    m = pq.read_table(d / "metrics.parquet").to_pylist()
    assert [r["round"] for r in m] == list(range(1, 9))
    assert len(m[0]["per_class_accuracy"]) == 10
    assert m[-1]["bytes_up"] > m[0]["bytes_up"] > 0


# One algorithm per way a client's work can depend on where it runs: none (fedavg), client
# state (scaffold's c_i), state holding a model (moon), the steps taken (fednova). The others
# (fedprox, fedavgm, fedrs, fedlc) change only arithmetic on the same path; each of them runs
# in tests/test_settings.py.
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", "fednova", "moon"])
def test_same_model_with_one_or_three_actors(ray_local, tmp_path, algorithm):
    common = [f"algorithm={algorithm}", "participation=0.75", "resources.num_cpus_per_actor=1"]
    d1, s1 = run(tmp_path, "one", *common, "resources.clients_per_actor=12")
    d3, s3 = run(tmp_path, "three", *common, "resources.clients_per_actor=4")
    assert "1 client actors" in (d1 / "log.txt").read_text()
    assert "3 client actors" in (d3 / "log.txt").read_text()
    m1, m3 = torch.load(d1 / "model.pt"), torch.load(d3 / "model.pt")
    for k in m1["global"]:
        assert torch.equal(m1["global"][k], m3["global"][k]), k  # bit-identical
    assert s1["final_accuracy"] == s3["final_accuracy"]


# FedConcat: randomness on the server (k-means, the classifier stage) and on the clients
# (probes), client state, two stages: where an earlier run in the same processes could leak.
@pytest.mark.parametrize("algorithm", ["fedconcat"])
def test_reused_workers_give_the_same_model_as_fresh_ones(ray_local, tmp_path, algorithm):
    common = [f"algorithm={algorithm}", "participation=0.5", "resources.num_actors=1"] + \
        (["fedconcat.encoder_rounds=2"] if algorithm == "fedconcat" else [])
    d_fresh, s_fresh = run(tmp_path, "fresh", *common, "ray.reuse_workers=false")
    run(tmp_path, "other", "algorithm=scaffold", "seed=3")  # leaves its processes, with their state
    d_warm, s_warm = run(tmp_path, "warm", *common)
    assert "reused from an earlier run" in (d_warm / "log.txt").read_text()
    assert "reused from an earlier run" not in (d_fresh / "log.txt").read_text()
    m_fresh, m_warm = torch.load(d_fresh / "model.pt"), torch.load(d_warm / "model.pt")
    fresh, warm = tensors(m_fresh), tensors(m_warm)  # FedConcat's clusters' encoders too (a list)
    assert fresh.keys() == warm.keys() and any(k.startswith("clusters.") for k in fresh)
    for k, v in fresh.items():
        assert torch.equal(v, warm[k]), k
    assert s_fresh["final_accuracy"] == s_warm["final_accuracy"]


def test_a_run_of_fewer_actors_leaves_the_others_idle_for_the_next_run_of_more(ray_local, tmp_path):
    """3 actors, then 1 (the other 2 stay idle: they hold nothing it needs), then 3 again:
    all 3 reused, none started; actors reserving something else are stopped, not kept."""
    d3, _ = run(tmp_path, "three", "resources.num_actors=3", "rounds=1")
    d1, _ = run(tmp_path, "one", "resources.num_actors=1", "rounds=1")
    again, _ = run(tmp_path, "again", "resources.num_actors=3", "rounds=1")
    assert "1 client actor" in (d1 / "log.txt").read_text()
    assert "3 client actors (1 CPU each) for 12 clients (resources.num_actors=3); 3 of them reused" in \
        (again / "log.txt").read_text()
    other, _ = run(tmp_path, "other", "resources.num_actors=2", "resources.num_cpus_per_actor=2", "rounds=1")
    assert "reused" not in (other / "log.txt").read_text().split("client actors")[1].splitlines()[0]


def test_one_actor_per_client_gives_the_same_model(ray_local, tmp_path):
    common = ["num_clients=4", "participation=0.5", "resources.num_cpus_per_actor=0.5"]
    d1, _ = run(tmp_path, "packed", *common, "resources.clients_per_actor=4")
    d4, _ = run(tmp_path, "literal", *common, "resources.clients_per_actor=1")
    assert "4 client actors" in (d4 / "log.txt").read_text()
    m1, m4 = torch.load(d1 / "model.pt"), torch.load(d4 / "model.pt")
    assert all(torch.equal(m1["global"][k], m4["global"][k]) for k in m1["global"])


def test_a_client_actor_killed_mid_round_is_redone_and_changes_nothing(ray_local, tmp_path):
    """The actor training client 5 in round 2 dies (the OOM killer's case): its call (clients
    4..7) is made again on another actor within round 2, recorded as `redone`, not dropped,
    and the run ends with the model of the same run without the crash, bit for bit. A
    stateful algorithm (SCAFFOLD's client variates) too."""
    for algorithm in ("fedavg", "scaffold"):
        common = [f"algorithm={algorithm}", "participation=1.0", "rounds=4", "resources.clients_per_actor=4"]
        d, s = run(tmp_path, f"crash-{algorithm}", *common, "faults.crash_round=2", "faults.crash_client=5")
        clean, _ = run(tmp_path, f"clean-{algorithm}", *common)
        assert s["rounds"] == 4
        rows = pq.read_table(d / "clients.parquet").to_pylist()
        assert not [r for r in rows if r["status"] == "dropped"]
        assert sorted(r["cid"] for r in rows if r["redone"]) == [4, 5, 6, 7]
        assert all(r["round"] == 2 and r["status"] == "ok" for r in rows if r["redone"])
        assert [r["dropped"] for r in pq.read_table(d / "metrics.parquet").to_pylist()] == [0, 0, 0, 0]
        log = (d / "log.txt").read_text()
        assert re.search(r"round 2: client actor 1 \(Actor\w*Error, on node \w{8} at [\d.]+\) lost the call of "
                         r"clients \[4, 5, 6, 7\]; redone on actor [02], on node \w{8} at [\d.]+ in [\d.]+ s", log), log
        a, b = (torch.load(x / "model.pt", weights_only=True) for x in (d, clean))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k])), algorithm


def test_client_state_persists_between_rounds_across_actors(ray_local, tmp_path):
    d, _ = run(tmp_path, "state", "plugins=[stateful_plugin]", "algorithm=test_state_counter",
               "participation=0.5", "rounds=6", "resources.clients_per_actor=4",
               "faults.crash_round=4", "faults.crash_client=0")
    rows = pq.read_table(d / "clients.parquet").to_pylist()
    seen: dict = {}
    for r in sorted(rows, key=lambda r: r["round"]):
        if r["status"] != "ok":
            continue
        seen[r["cid"]] = seen.get(r["cid"], 0) + 1
        # the count kept in the client's state equals the rounds it completed,
        # whichever actor ran it and even after an actor died
        assert r["loss"] == seen[r["cid"]], r
    assert max(seen.values()) >= 3


def test_results_command_prints_summary_and_plots(ray_local, tmp_path):
    from raysim.results.__main__ import main as results_main

    d, s = run(tmp_path, "report")
    assert results_main([str(d)]) == 0
    assert (d / "accuracy.png").stat().st_size > 1000


def test_actor_killed_between_rounds_comes_back_with_its_data(ray_local, tmp_path):
    """Ray restarts an actor that died while idle; its next call finds no data, so the call
    is made again on it with the data: no client is dropped, the call's clients are `redone`."""
    import os
    import time

    import ray

    from raysim.config import read_layers
    from raysim.runtime import pool
    from raysim.runtime.server import FederatedServer

    pool.release()  # the CPUs that earlier runs' idle actors hold
    layers = read_layers([], [*[b for b in BASE if b != "--quiet"], "participation=1.0", "resources.clients_per_actor=6",
                              "rounds=4", f"output_dir={tmp_path}", "run_name=idle", "ray.reuse_workers=false"])
    server = FederatedServer(time.time())
    server.setup(layers, os.getcwd())
    server.open_run()
    assert server.step(1)["dropped"] == 0
    pid = server.actor_info()[0]["pid"]
    ray.kill(server.dispatch.actors[0], no_restart=False)
    deadline = time.time() + 60
    while time.time() < deadline:  # wait for Ray to bring the actor back as a new process
        try:
            if ray.get(server.dispatch.actors[0].device_info.remote(), timeout=5)["pid"] != pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.2)
    assert server.step(2)["dropped"] == 0  # clients 0-5 reached the restarted actor without data: redone
    log = (tmp_path / "idle" / "log.txt").read_text()
    assert re.search(r"round 2: client actor 0 \(restarted without its data, on node \w{8} at [\d.]+\) lost the call of "
                     r"clients \[0, 1, 2, 3, 4, 5\]; redone on actor 0", log), log
    assert server.step(3)["dropped"] == 0
    server.finish()


def test_a_bug_in_a_plugin_is_a_few_lines_and_log_txt_has_the_traceback(ray_local, tmp_path, capsys):
    code = main([*BASE, "plugins=[stateful_plugin]", "algorithm=test_fails_in_round_3", "rounds=5",
                 f"output_dir={tmp_path}", "run_name=bug"])
    assert code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("raysim [")]
    assert 2 <= len(err) <= 4 and "Traceback" not in "\n".join(err), err
    assert err[0] == "error: ValueError: bug in round 3"
    assert "stateful_plugin.py:" in err[1] and "in client_update" in err[1] and 'raise ValueError("bug' in err[1]
    d = tmp_path / "bug"
    assert str(d / "log.txt") in err[-1]
    assert [r["round"] for r in pq.read_table(d / "metrics.parquet").to_pylist()] == [1, 2]
    assert not (d / "summary.json").exists()
    log = (d / "log.txt").read_text()
    assert "round 3 failed:" in log and "Traceback" in log and "stateful_plugin.py" in log
    assert "run stopped before its last round" in log


def test_fedentopt_with_fedprox_dropout_and_stragglers(ray_local, tmp_path):
    common = ["selection=fedentopt", "algorithm=fedprox", "partition=classes", "partition.k=1",
              "num_clients=20", "participation=0.5", "rounds=4"]
    d, s = run(tmp_path, "sys", *common, "system.dropout=0.3", "system.stragglers=0.5", "system.straggler_epochs=[2,4]")
    assert s["rounds"] == 4
    rows = pq.read_table(d / "clients.parquet").to_pylist()
    dropouts = [r for r in rows if r["reason"] == "dropout"]
    assert dropouts and all(r["status"] == "dropped" and r["loss"] is None for r in dropouts)
    trained = [r for r in rows if r["status"] == "ok"]
    assert {r["epochs"] for r in trained if not r["straggler"]} == {1}  # local.epochs
    slow = {r["epochs"] for r in trained if r["straggler"]}
    assert slow and slow <= {2, 3, 4} and len(slow) > 1
    m = pq.read_table(d / "metrics.parquet").to_pylist()
    assert [r["dropped"] for r in m] == [sum(1 for x in rows if x["round"] == rnd and x["status"] == "dropped")
                                         for rnd in range(1, 5)]
    assert all(len(r["selected"]) == 10 for r in m)
    # without the system settings: nobody drops out and everyone trains local.epochs
    d0, _ = run(tmp_path, "nosys", *common)
    rows0 = pq.read_table(d0 / "clients.parquet").to_pylist()
    assert all(r["status"] == "ok" and r["epochs"] == 1 for r in rows0)


def test_fedentopt_picks_more_balanced_cohorts_than_random(ray_local, tmp_path):
    common = ["partition=classes", "partition.k=1", "num_clients=20", "participation=0.25", "rounds=4"]

    def mean_entropy(name, selection):
        d, _ = run(tmp_path, name, f"selection={selection}", *common)
        m = pq.read_table(d / "metrics.parquet").to_pylist()
        return sum(r["cohort_entropy"] for r in m) / len(m), [r["cohort_labels"] for r in m]

    ent, labels = mean_entropy("ent", "fedentopt")
    rnd, _ = mean_entropy("rnd", "random")
    assert labels == [5, 5, 5, 5]  # 5 single-label clients, 5 different labels every round
    assert ent > rnd


@pytest.mark.slow
def test_augmented_training_on_colour_images(ray_local, tmp_path):
    import pickle

    import numpy as np

    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / f, "wb") as fh:
            pickle.dump({"data": rng.integers(0, 256, (40, 3072)).astype(np.uint8),
                         "labels": rng.integers(0, 10, 40).tolist()}, fh)
    common = ["dataset=cifar10", f"data_dir={tmp_path}", "download=false", "model=cnn", "num_clients=8",
              "partition=iid", "participation=0.5", "rounds=2"]
    d1, _ = run(tmp_path, "aug", *common, "local.augment=true")
    d2, _ = run(tmp_path, "aug2", *common, "local.augment=true")
    d3, _ = run(tmp_path, "plain", *common)
    m1, m2, m3 = (torch.load(d / "model.pt")["global"] for d in (d1, d2, d3))
    assert all(torch.equal(m1[k], m2[k]) for k in m1)  # augmentation draws from the client's seed
    assert not all(torch.equal(m1[k], m3[k]) for k in m1)  # ... and changes what is trained
    assert main(["local.augment=true", f"output_dir={tmp_path}", "run_name=bad", "--quiet"]) == 2  # digits: grey
    # NIID-Bench's recipe: [0, 1] inputs, reflect-pad-4 crop and flip
    d4, s4 = run(tmp_path, "crop", *common, "local.augment=crop_flip", "input_scale=unit")
    m4 = torch.load(d4 / "model.pt")["global"]
    assert not all(torch.equal(m4[k], m3[k]) for k in m4) and s4["rounds"] == 2


def test_placement_balances_work_and_keeps_id_order():
    from raysim.runtime import placement

    work = {c: 10 for c in range(10)}
    work[0] = 50  # a straggler with five times the work
    runs = placement.assign(list(range(10)), work, 2, one_per_client=False)
    assert [c for _, chunk in runs for c in chunk] == list(range(10))  # contiguous, in id order
    loads = [sum(work[c] for c in chunk) for _, chunk in runs]
    assert len(runs) == 2 and loads == [70, 70]  # total 140; five clients each would be 90 | 50
    assert placement.assign([3, 7], work, 4, one_per_client=True) == [(3, [3]), (7, [7])]


def test_fednova_normalises_by_the_steps_stragglers_take(ray_local, tmp_path):
    common = ["algorithm=fednova", "num_clients=10", "participation=0.5", "rounds=3", "local.epochs=1"]
    d, _ = run(tmp_path, "nova-slow", *common, "system.stragglers=0.5", "system.straggler_epochs=[2,4]")
    d0, _ = run(tmp_path, "nova", *common)
    slow = [r["tau_eff"] for r in pq.read_table(d / "metrics.parquet").to_pylist()]
    plain = [r["tau_eff"] for r in pq.read_table(d0 / "metrics.parquet").to_pylist()]
    assert all(s > p for s, p in zip(slow, plain))  # stragglers' extra epochs raise the effective step count
    rows = pq.read_table(d / "clients.parquet").to_pylist()
    assert {r["epochs"] for r in rows if r["straggler"]} - {1}  # some stragglers really took more epochs


def test_a_diverged_run_stops_with_one_line_and_keeps_the_rounds_before(ray_local, tmp_path, capsys):
    code = main([*BASE, "rounds=6", "plugins=[stateful_plugin]", "algorithm=test_nan_in_round_3",
                 f"output_dir={tmp_path}", "run_name=nan"])
    assert code == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and err[0].startswith("error: round 3: test_nan_in_round_3 diverged: train_loss=nan")
    assert "local.lr" in err[0]
    d = tmp_path / "nan"
    assert [r["round"] for r in pq.read_table(d / "metrics.parquet").to_pylist()] == [1, 2]
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "diverged" and s["diverged_round"] == 3 and s["final_accuracy"] > 0.1
    assert s["client_processors"] and "torch" in s["client_processors"][0]  # where its bits came from
    assert not (d / "model.pt").exists()  # no NaN model is left as the run's result
    # an algorithm with a step of its own names it (Algorithm.divergence_hint): pFedMe's inner step, not local.lr
    assert main([*BASE, "rounds=3", "plugins=[stateful_plugin]", "algorithm=test_pfedme_nan_in_round_2",
                 f"output_dir={tmp_path}", "run_name=nan2"]) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "pfedme.personal_lr x (L + pfedme.lam) < 2" in err[0] and "L under 185" in err[0]
    assert "local.lr" not in err[0]


def test_a_model_that_collapsed_to_chance_is_a_diverged_run(ray_local, tmp_path, capsys):
    """Issue 84: a run whose model falls to chance without a NaN (FedDyn's objective running
    away below zero on mnist_c2) counted as finished. Here the clients return all-zero weights
    from round 4 (one class predicted): at the third evaluation in a row at or under 1.5 / 10 it
    stops as diverged; `diverged_collapse=false` runs on, and so does a run under attack (a
    collapse is what an attack measures)."""
    from raysim.registry import ALGORITHMS
    from raysim.runtime.server import collapsed, serves_clients

    # judged by the server's model only where it serves the clients: not a clustered method's mean of
    # its group models (FeSEM's at 10-13 % on mnist_c2, its clients at 87-90 %) nor a personalised one's
    assert serves_clients(ALGORITHMS.get("fedavg")) and serves_clients(ALGORITHMS.get("feddyn"))
    assert not any(serves_clients(ALGORITHMS.get(a)) for a in ("fesem", "ifca", "fedgroup", "fedper", "fedrep"))

    assert collapsed([0.5, 0.1, 0.12, 0.15], 10) and not collapsed([0.5, 0.1, 0.12, 0.16], 10)
    assert not collapsed([0.1, 0.12, 0.15], 10)  # never above chance: not a collapse (nothing earlier)
    assert not collapsed([0.29, 0.1, 0.1, 0.1], 10) and collapsed([0.3, 0.1, 0.1, 0.1], 10)
    zero = [*BASE, "rounds=9", "plugins=[stateful_plugin]", "algorithm=test_zero_from_round_4", f"output_dir={tmp_path}"]
    assert main([*zero, "run_name=zero", "--quiet"]) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "test_zero_from_round_4 collapsed to chance: test accuracy" in err[0]
    s = json.loads((tmp_path / "zero" / "summary.json").read_text())
    rows = pq.read_table(tmp_path / "zero" / "metrics.parquet").to_pylist()
    assert s["status"] == "diverged" and s["diverged_round"] == 6 and len(rows) == 5
    assert max(r["accuracy"] for r in rows) >= 0.3 and all(r["accuracy"] <= 0.15 for r in rows[-2:])
    assert all(r["weight_rms"] > 0 for r in rows[:3]) and all(r["weight_rms"] == 0 for r in rows[3:])
    assert main([*zero, "run_name=on", "diverged_collapse=false", "--quiet"]) == 0
    assert json.loads((tmp_path / "on" / "summary.json").read_text())["status"] == "finished"
    assert main([*zero, "run_name=attacked", "attack.kind=gaussian", "attack.fraction=0.1", "--quiet"]) == 0


def test_footprint_counts_buffers_once_and_gives_expanded_parts_what_they_hold():
    """runtime/footprint.py, behind scale.py's bytes per idle client: an array by its buffer,
    a tensor by its storage, an object shared by two parts counted once, in the part named
    in `expand` (which comes first whatever the attribute order)."""
    import types

    import numpy as np
    import torch

    from raysim.runtime.footprint import deep_bytes, parts_bytes

    a = np.zeros(10_000, dtype=np.int64)  # 80,000 bytes
    assert 80_000 <= deep_bytes(a, set()) < 81_000
    assert 80_000 <= deep_bytes(a[::2], set()) < 81_000  # a view: its base's buffer
    assert 40_000 <= deep_bytes(torch.zeros(10_000), set()) < 41_000
    rows = [{"cid": i} for i in range(1000)]
    assert deep_bytes(rows, set()) > 1000 * 200  # a dict per row: hundreds of bytes each
    inner = types.SimpleNamespace(table=a, n=1)
    server = types.SimpleNamespace(first=a, record=inner, small=[1, 2])
    parts = parts_bytes(server, expand=("record",))
    assert parts["record.table"] >= 80_000 and parts["first"] < 1_000  # the shared array is the record's
    assert parts["small"] < 200
