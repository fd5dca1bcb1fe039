"""Issue 41's CPU half: deterministic kernels in every client actor (`determinism`), and
vectorised groups sent as one float64 sum made where they trained, bit-identical whatever
the number of actors, across resume, and equal to the in-process server's; algorithms and
attacks that need each client's model still get it."""
import json

import pyarrow.parquet as pq
import pytest
import torch

from raysim.contract import ClientResult
from raysim.run import main
from raysim.training import pairwise_sum, partial_sum, stacked_sum
import raysim.training as training
from same_bits import same_bits_on_ray_and_in_process


def test_every_client_actor_trains_with_the_determinism_settings_unless_the_option_turns_them_off(ray_local,
                                                                                                   tmp_path):
    common = ["plugins=[determinism_probe]", "algorithm=test_determinism_probe", "dataset=digits", "num_clients=6",
              "participation=1.0", "rounds=2", "resources.num_actors=2", f"output_dir={tmp_path}", "--quiet"]
    for on in (True, False):
        name = f"det-{on}"
        assert main([*common, f"determinism={str(on).lower()}", f"run_name={name}"]) == 0
        states = torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["client_states"]
        assert sorted(states) == list(range(6))
        for s in states.values():  # [deterministic algorithms, cudnn.deterministic, cudnn.benchmark, cuBLAS workspace]
            assert s["settings"].tolist() == [on, on, not on, True]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["determinism"] is on and summary["client_devices"] == ["cpu"]
        assert f"determinism: {str(on).lower()}" in (tmp_path / name / "config.yaml").read_text()


def test_a_group_sum_is_the_pairwise_sum_of_the_weighted_models_in_float64_however_it_is_chunked():
    g = torch.Generator().manual_seed(0)
    update = {"w": torch.randn(5, 7, 3, generator=g), "b": torch.randn(5, 3, generator=g),
              "count": torch.tensor([3, 9, 1, 4, 2])}
    results = [ClientResult(c, n, None, {"loss": float(c)}) for c, n in zip(range(10, 15), [4, 1, 7, 2, 9])]
    n = torch.tensor([4.0, 1, 7, 2, 9], dtype=torch.float64)
    summed = stacked_sum(update, results)
    for k in ("w", "b"):
        t = update[k].double() * n.view(-1, *[1] * (update[k].dim() - 1))
        by_hand = ((t[0] + t[1]) + (t[2] + t[3])) + t[4]  # adjacent pairs, level by level, the odd one carried
        assert torch.equal(summed.update[k], by_hand)
        assert torch.equal(summed.update[k], pairwise_sum(t.clone()))
    assert torch.equal(summed.update["count"], torch.tensor(9))  # integer entries: the largest, as WeightedMean
    assert summed.num_samples == 23 and summed.cid == 10
    assert summed.metrics["loss"] == pytest.approx(sum(c * w for c, w in zip(range(10, 15), [4, 1, 7, 2, 9])) / 23)
    assert [c[0] for c in summed.clients] == list(range(10, 15))
    old = training.SUM_CHUNK
    try:
        training.SUM_CHUNK = 7  # columns a few at a time: the same bits
        chunked = stacked_sum(update, results)
    finally:
        training.SUM_CHUNK = old
    assert all(torch.equal(chunked.update[k], summed.update[k]) for k in summed.update)
    per_client = [ClientResult(r.cid, r.num_samples, {k: v[i] for k, v in update.items()}, r.metrics)
                  for i, r in enumerate(results)]
    sequential = partial_sum(per_client)  # the per-client path's fold: the same sum in another order
    assert all(torch.allclose(sequential.update[k].double(), summed.update[k].double()) for k in summed.update)


def _model(path):
    return torch.load(path / "model.pt", weights_only=True)["global"]


@pytest.mark.parametrize("extra", [[], ["attack.kind=sign_flip", "attack.fraction=0.3"], ["server.aggregator=median"]],
                         ids=["sums", "attacked-groups", "each-model"])
def test_vectorised_groups_are_bit_identical_for_1_2_and_3_actors_and_in_process(ray_local, tmp_path, extra):
    """Plain FedAvg sends one sum per group; a group with a sign-flipping attacker is cut,
    attacked and summed again; the median needs every model, so groups are cut into clients."""
    common = ["dataset=digits", "model=mlp", "num_clients=20", "participation=0.6", "rounds=3", "local.vectorize=true",
              "local.vectorize_group=4", "checkpoint_every=0", *extra]
    models, rows = same_bits_on_ray_and_in_process(tmp_path, common, (1, 2, 3))
    assert all(len(r) == 3 * 12 and all(x["loss"] is not None and x["status"] == "ok" for x in r) for r in rows)
    metrics = pq.read_table(tmp_path / "a1" / "metrics.parquet").to_pylist()
    summed = not extra or "attack.kind=sign_flip" in extra
    n_params = sum(v.numel() for v in models[0].values())
    # a sum per group of 4 (3 groups of 12 clients), in float64; or 12 float32 models
    assert metrics[1]["round_bytes_up"] == (3 * n_params * 8 if summed else 12 * n_params * 4)


def test_a_vectorised_run_resumed_from_its_checkpoint_ends_with_the_same_bits(ray_local, tmp_path):
    common = ["dataset=digits", "model=mlp", "num_clients=20", "participation=0.6", "local.vectorize=true",
              "local.vectorize_group=4", "checkpoint_every=5", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=2", "run_name=short", "resources.num_actors=1"]) == 0
    assert main([f"resume={tmp_path / 'short'}", "rounds=4", "resources.num_actors=2", "--quiet"]) == 0
    assert main([*common, "rounds=4", "run_name=long", "resources.num_actors=3"]) == 0
    a, b = _model(tmp_path / "short"), _model(tmp_path / "long")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_the_gpu_benchmark_runs_dry_on_the_cpu_and_checks_the_bits(ray_local, tmp_path):
    """benchmarks/gpu.py --dry: one row of each code path, the identity checks, the plain
    loop, the results file written as it goes; without a GPU and without --dry it refuses."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("gpu_benchmark", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    out = tmp_path / "gpu.txt"
    assert gpu.main(["--dry", "--out", str(out)]) == 0
    text = out.read_text()
    for line in ("2 CPU actors, determinism=false", "1 CPU actor, vectorised, groups of 250", "not vectorised",
                 "plain torch loop, one process, shards on cpu", "determinism costs",
                 "identical: the per-client path", "identical: the vectorised path"):
        assert line in text, line
    assert "DIFFERENT" not in text
    if not torch.cuda.is_available():
        assert gpu.main(["--out", str(tmp_path / "no.txt")]) == 2


def test_an_actors_clients_in_several_tasks_fold_to_the_same_bits(ray_local, tmp_path):
    """resources.tasks_per_actor=4 (the default for models of 1 MB or more on GPU actors):
    each actor's clients go in up to 4 tasks, the server folding the first while the actor
    trains on; the fold is still in client-id order, so 1 and 2 actors and the in-process
    server give the same bits."""
    from omegaconf import OmegaConf

    from raysim.runtime.dispatch import PIPELINE_BYTES, pipeline, tasks_per_actor

    assert pipeline(list(range(10)), None, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert pipeline(list(range(10)), None, 1) == [list(range(10))]
    assert pipeline(list(range(8)), [4, 4], 4) == [list(range(8))]  # blocks stay whole
    gpu = OmegaConf.create({"tasks_per_actor": None, "num_gpus_per_actor": 0.25})
    cpu = OmegaConf.create({"tasks_per_actor": None, "num_gpus_per_actor": 0.0})
    assert tasks_per_actor(gpu, PIPELINE_BYTES) == 4 and tasks_per_actor(gpu, PIPELINE_BYTES - 1) == 1
    assert tasks_per_actor(cpu, PIPELINE_BYTES) == 1
    common = ["dataset=digits", "model=mlp", "num_clients=12", "participation=1.0", "rounds=2", "checkpoint_every=0",
              "resources.tasks_per_actor=4"]
    _, rows = same_bits_on_ray_and_in_process(tmp_path, common, (1, 2))
    for r in rows:
        assert sorted((x["round"], x["cid"]) for x in r) == [(rnd, c) for rnd in (1, 2) for c in range(12)]


def test_determinism_switch_sets_torchs_flags_without_importing_inductor():
    """`determinism.apply` turns torch's deterministic switch on and off without importing
    TorchInductor (149 MB and ~2 s of CPU in every process, torch 2.14); Inductor, imported
    later, reads the same setting."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from raysim.runtime import determinism\n"
            "determinism.apply(True)\n"
            "assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()\n"
            "assert 'torch._inductor' not in sys.modules, 'inductor imported'\n"
            "determinism.apply(False)\n"
            "assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark\n"
            "determinism.apply(True)\n"
            "import torch._inductor.config as c\n"
            "assert c.deterministic is True\n"
            "determinism.apply(False)\n"
            "assert c.deterministic is False and not torch.are_deterministic_algorithms_enabled()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
