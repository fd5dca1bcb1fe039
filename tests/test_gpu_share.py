"""Issue 59's CPU half: `resources.num_gpus_per_actor=auto` (the packing arithmetic, the
one-line refusal, the probe's flow on a Ray without GPUs) and `eval.where` (the test set
evaluated by a client actor gives the server's numbers on the same device). The
measurement itself runs on a GPU: benchmarks/gpu.py."""
import json

import pyarrow.parquet as pq
import pytest
import torch

from raysim.errors import ConfigError
from raysim.run import main
from raysim.runtime import gpu_packing

MiB = 2**20


def test_actors_per_gpu_is_the_memory_left_after_headroom_over_one_actors_footprint():
    # 80 GiB, 10 % kept free: 72 GiB over (500 MiB context + 1,000 MiB peak) = 49.15 -> 49
    assert gpu_packing.actors_per_gpu(80 * 1024 * MiB, 500 * MiB, 1000 * MiB, 0.1) == 49
    assert gpu_packing.actors_per_gpu(80 * 1024 * MiB, 500 * MiB, 1000 * MiB, 0.0) == 54
    assert gpu_packing.actors_per_gpu(1000 * MiB, 600 * MiB, 400 * MiB, 0.1) == 0  # one does not fit
    assert gpu_packing.share(49) == 0.0204 and gpu_packing.share(3) == 0.3333 and gpu_packing.share(1) == 1.0
    assert 49 * gpu_packing.share(49) <= 1.0


def test_decide_records_the_measurement_and_refuses_a_client_that_does_not_fit_in_one_line():
    probe = {"device": "cuda", "total": 80 * 1024 * MiB, "context": 500 * MiB, "peak_reserved": 1000 * MiB,
             "peak_allocated": 700 * MiB}
    frac, record, line = gpu_packing.decide(probe, 0.1, "client 3, 600 samples, batch 32")
    assert frac == 0.0204 and record["actors_per_gpu"] == 49 and record["peak_reserved_bytes"] == 1000 * MiB
    assert "1,000 MiB" in line and "500 MiB" in line and "49 actors fit" in line and "client 3" in line
    with pytest.raises(ConfigError, match=r"needs 9,100 MiB .* a GPU has 8,192 MiB \(10% kept free"):
        gpu_packing.decide({**probe, "total": 8 * 1024 * MiB, "peak_reserved": 8600 * MiB}, 0.1, "client 3")
    with pytest.raises(ConfigError, match="more than the whole GPU"):
        gpu_packing.decide({**probe, "oom": True}, 0.1, "client 3")
    frac, record, line = gpu_packing.decide({"device": "cpu"}, 0.1, "client 3")
    assert frac == 1.0 and record["measured"] is False and "no CUDA device" in line


def test_the_probe_trains_the_largest_client_or_the_first_vectorised_group():
    sizes = [5, 9, 9, 2, 7]
    assert gpu_packing.probe_clients([4, 1, 3, 2], sizes, 0) == [1]  # ties: the lower id
    assert gpu_packing.probe_clients([4, 0, 3, 2], sizes, 2) == [0, 2]


@pytest.mark.parametrize("value, words", [("most", "a number >= 0 (a GPU fraction) or 'auto'"), ("-1", ">= 0")])
def test_a_bad_num_gpus_per_actor_is_one_line(tmp_path, capsys, value, words):
    assert main(["dataset=digits", f"resources.num_gpus_per_actor={value}", f"output_dir={tmp_path}", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "resources.num_gpus_per_actor" in err and words in err and "Traceback" not in err


def test_auto_on_a_ray_without_gpus_trains_on_the_cpus_and_says_so(ray_local, tmp_path):
    common = ["dataset=digits", "model=mlp", "num_clients=8", "participation=0.5", "rounds=2", "resources.num_actors=2",
              f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "resources.num_gpus_per_actor=auto", "run_name=auto"]) == 0
    assert main([*common, "run_name=plain"]) == 0
    log = (tmp_path / "auto" / "log.txt").read_text()
    assert "num_gpus_per_actor=auto: the cluster has no GPU" in log and "2 client actors (1 CPU each)" in log
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("auto", "plain"))
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_the_test_set_evaluated_by_a_client_actor_gives_the_servers_numbers_on_the_same_device(ray_local, tmp_path):
    """CReFF evaluates two models a round (its re-trained classifier and the FedAvg model: two
    actors, one each) and CCVR one more after training (after_training's): evaluated by the
    actors or by the server, the same accuracy and loss, bit for bit (both on this CPU, the
    same batches); the model is the same either way."""
    common = ["dataset=digits", "model=mlp", "num_clients=8", "participation=0.5", "rounds=2",
              "resources.num_actors=2", "eval_every=1", f"output_dir={tmp_path}", "--quiet"]
    creff = ["algorithm=creff", "creff.match_steps=5", "creff.retrain_epochs=2"]
    for where in ("server", "clients"):
        assert main([*common, *creff, f"eval.where={where}", f"run_name=creff-{where}"]) == 0
    ms, mc = (pq.read_table(tmp_path / f"creff-{w}" / "metrics.parquet").to_pylist() for w in ("server", "clients"))
    assert [(r["accuracy"], r["global_accuracy"], r["loss"], r["global_loss"]) for r in ms] == \
        [(r["accuracy"], r["global_accuracy"], r["loss"], r["global_loss"]) for r in mc]
    assert ms[-1]["accuracy"] != ms[-1]["global_accuracy"]  # two models, not one twice
    common = [*common, "algorithm=ccvr"]
    for where in ("server", "clients"):
        assert main([*common, f"eval.where={where}", f"run_name={where}"]) == 0
    s, c = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("server", "clients"))
    assert (s["eval_where"], c["eval_where"]) == ("server", "clients")
    assert c["final_accuracy"] == s["final_accuracy"] and c["after_training"] == s["after_training"]
    ms, mc = (pq.read_table(tmp_path / n / "metrics.parquet").to_pylist() for n in ("server", "clients"))
    assert [(r["accuracy"], r["loss"], r["per_class_accuracy"]) for r in ms] == \
        [(r["accuracy"], r["loss"], r["per_class_accuracy"]) for r in mc]
    log = (tmp_path / "clients" / "log.txt").read_text()
    assert "evaluation: on a client actor (eval.where=clients)" in log and "made on the server" not in log
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("server", "clients"))
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_eval_where_auto_stays_on_the_server_when_the_clients_train_on_cpus(ray_local, tmp_path):
    assert main(["dataset=digits", "model=mlp", "num_clients=4", "rounds=1", "resources.num_actors=1",
                 f"output_dir={tmp_path}", "run_name=auto", "--quiet"]) == 0
    assert json.loads((tmp_path / "auto" / "summary.json").read_text())["eval_where"] == "server"
    assert main(["dataset=digits", "eval.where=gpu", f"output_dir={tmp_path}", "--quiet"]) == 2
