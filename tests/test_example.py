"""examples/my_algorithm.py, the worked example of docs/writing-an-algorithm.md: one file
is a whole algorithm, unit-tested without Ray and run by the CLI as a user's plugin."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raysim.contract import ClientResult
from raysim.config import load_config
from raysim.testing import InProcessServer

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture(autouse=True)
def my_algorithm():
    """Import the example (it registers `server_step`), as `plugins=[my_algorithm]` would."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import my_algorithm

        yield my_algorithm
    finally:
        sys.path.remove(str(EXAMPLES))


def linear():
    """A 2 -> 1 linear model with weight [0, 4] and bias 1."""
    m = torch.nn.Linear(2, 1)
    m.load_state_dict({"weight": torch.tensor([[0.0, 4.0]]), "bias": torch.tensor([1.0])})
    return m


def server_for(model, *overrides):
    cfg = load_config(overrides=["algorithm=server_step", "num_clients=2", *overrides])
    data = [(torch.zeros(4, 2), torch.tensor([0, 1, 0, 1])) for _ in range(2)]
    server = InProcessServer(cfg, data, model=model)
    server.setup()
    return server


def test_the_server_moves_eta_of_the_way_to_the_sample_weighted_mean():
    algo = server_for(linear, "server_step.eta=0.5").algorithm
    results = [ClientResult(0, 10, {"weight": torch.tensor([[1.0, 0.0]]), "bias": torch.tensor([1.0])}, {"loss": 1.0}),
               ClientResult(1, 30, {"weight": torch.tensor([[5.0, 4.0]]), "bias": torch.tensor([-1.0])}, {"loss": 3.0})]
    out = algo.aggregate(1, iter(results))
    # mean: weight [4, 3], bias -0.5; halfway from [0, 4], 1
    assert torch.allclose(algo.model.weight, torch.tensor([[2.0, 3.5]])) and torch.allclose(algo.model.bias, torch.tensor([0.25]))
    assert out["train_loss"] == (10 * 1.0 + 30 * 3.0) / 40


def test_batchnorm_statistics_take_the_plain_mean_not_the_step():
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))

    algo = server_for(net, "server_step.eta=0.5").algorithm
    start = {k: v.clone() for k, v in algo.model.state_dict().items()}
    ones = {k: torch.ones_like(v) if v.is_floating_point() else v for k, v in start.items()}
    algo.aggregate(1, iter([ClientResult(0, 1, ones, {"loss": 0.0})]))
    now = algo.model.state_dict()
    assert torch.equal(now["1.running_mean"], torch.ones(2)) and torch.equal(now["1.running_var"], torch.ones(2))
    assert torch.allclose(now["0.weight"], (start["0.weight"] + 1) / 2)


def test_eta_one_is_fedavg_on_real_training():
    torch.set_num_threads(1)
    common = ["dataset=digits", "num_clients=6", "participation=0.5", "rounds=3"]
    mine = InProcessServer.from_config(load_config(overrides=[*common, "algorithm=server_step"]))
    fedavg = InProcessServer.from_config(load_config(overrides=[*common, "algorithm=fedavg"]))
    a, b = mine.run(), fedavg.run()
    for k, v in fedavg.algorithm.model.state_dict().items():
        assert torch.allclose(mine.algorithm.model.state_dict()[k], v, atol=1e-6), k
    assert abs(a[-1]["accuracy"] - b[-1]["accuracy"]) < 0.01 and a[-1]["accuracy"] > 0.5


def test_the_cli_runs_it_as_a_plugin_and_checks_its_option(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]))
    cli = [sys.executable, "-m", "raysim.run", "plugins=[my_algorithm]", "algorithm=server_step", "dataset=digits",
           "num_clients=6", "rounds=4", "ray.num_cpus=2", f"output_dir={tmp_path}", "run_name=r", "--quiet"]
    bad = subprocess.run([*cli, "server_step.eta=0"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: server_step.eta must be > 0, got 0.0", bad.stderr
    ok = subprocess.run([*cli, "server_step.eta=1.5"], env=env, cwd=tmp_path, capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    import json

    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.5, summary


def test_the_docs_worked_example_is_this_file():
    doc = (REPO / "docs" / "writing-an-algorithm.md").read_text()
    block = doc.split("<!-- examples/my_algorithm.py -->\n```python\n", 1)[1].split("```", 1)[0]
    assert block == (EXAMPLES / "my_algorithm.py").read_text()
