"""Per-client evaluation (issue 12): each client's model on its own local test split."""
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raysim.run import main
from raysim.runtime.local_eval import LocalTests, local_tests


class Pick(torch.nn.Module):
    """Predicts class 0 when feature 0 > feature 1, else class 1 (or the reverse)."""

    def __init__(self, flip: bool = False):
        super().__init__()
        self.flip = flip

    def forward(self, x):
        out = torch.stack([x[:, 0], x[:, 1]], 1)
        return -out if self.flip else out


def test_weighted_accuracy_is_total_correct_over_total_local_samples():
    # 8 samples; each row (a, b) predicts 0 if a > b under Pick()
    x = np.array([[1, 0], [1, 0], [0, 1], [5, 5.5], [0, 1], [1, 0], [0, 1], [2, 1]], dtype=np.float32)
    y = np.array([0, 0, 0, 0, 1, 0, 1, 0])
    # client 0: samples 0, 1, 2 -> predictions 0, 0, 1: 2 of 3 right
    # client 1: sample 3 -> prediction 1 (5 < 5.5), label 0: 0 of 1
    # client 2: samples 4, 5, 6, 7 -> served by the flipped model: predictions 0, 1, 0, 1: 0 of 4
    # client 3: no local test data
    t = LocalTests(x, y, [np.array([0, 1, 2]), np.array([3]), np.array([4, 5, 6, 7]), np.array([], dtype=int)], torch.from_numpy)
    assert list(t.cids) == [0, 1, 2]
    metrics, per_client = t.evaluate({"a": Pick(), "b": Pick(flip=True)}, {"a": [0, 1], "b": [2, 3]})
    assert per_client == pytest.approx({0: 2 / 3, 1: 0.0, 2: 0.0})
    assert metrics["local_accuracy"] == pytest.approx(2 / 8)  # total correct / total local samples
    assert metrics["local_accuracy_mean"] == pytest.approx((2 / 3) / 3)
    assert metrics["local_accuracy_min"] == 0.0
    assert metrics["local_accuracy_p10"] == pytest.approx(np.percentile([2 / 3, 0, 0], 10))
    # the same model for everyone: client 2 gets 4 of 4 right
    metrics, per_client = t.evaluate({"a": Pick()}, {"a": [0, 1, 2, 3]})
    assert per_client[2] == 1.0 and metrics["local_accuracy"] == pytest.approx(6 / 8)
    assert local_tests(x, y, None, torch.from_numpy) is None and local_tests(x, y, [np.array([], dtype=int)], torch.from_numpy) is None


def test_fedavg_reports_per_client_accuracy_on_local_test_splits(ray_local, tmp_path):
    assert main(["dataset=digits", "num_clients=10", "rounds=3", "eval_every=2", "partition.test_fraction=0.2",
                 f"output_dir={tmp_path}", "run_name=local", "--quiet"]) == 0
    d = tmp_path / "local"
    metrics = pq.read_table(d / "metrics.parquet").to_pylist()
    evaluated = [r for r in metrics if r.get("local_accuracy") is not None]
    assert [r["round"] for r in evaluated] == [2, 3]  # evaluation rounds only (eval_every, last round)
    rows = [r for r in pq.read_table(d / "clients.parquet").to_pylist() if r["method"] == "evaluate"]
    for m in evaluated:
        mine = [r for r in rows if r["round"] == m["round"]]
        assert sorted(r["cid"] for r in mine) == list(range(10))
        correct = sum(r["accuracy"] * r["num_samples"] for r in mine)
        assert m["local_accuracy"] == pytest.approx(correct / sum(r["num_samples"] for r in mine))
        accs = [r["accuracy"] for r in mine]
        assert m["local_accuracy_min"] == pytest.approx(min(accs))
        assert m["local_accuracy_mean"] == pytest.approx(np.mean(accs))
    assert evaluated[-1]["local_accuracy"] > 0.3  # it learned (chance: 0.1)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["best_local_accuracy"] == max(m["local_accuracy"] for m in evaluated)


def test_a_sample_of_clients_evaluated_on_their_own_splits_each_round_the_same_for_any_actors(ray_local, tmp_path):
    """`eval.local_clients=4` of 12 (issue 73: the per-client column for a population of
    millions): each evaluation round 4 clients, drawn afresh; the round's figure is theirs;
    the same clients and figures with 1 or 2 actors; the summary says it was a sample."""
    common = ["dataset=digits", "num_clients=12", "rounds=4", "eval_every=2", "partition.test_fraction=0.2",
              "eval.local_clients=4", f"output_dir={tmp_path}", "--quiet"]
    picked = {}
    for actors in (1, 2):
        assert main([*common, f"resources.num_actors={actors}", f"run_name=a{actors}"]) == 0
        d = tmp_path / f"a{actors}"
        rows = [r for r in pq.read_table(d / "clients.parquet").to_pylist() if r["method"] == "evaluate"]
        metrics = [r for r in pq.read_table(d / "metrics.parquet").to_pylist() if r.get("local_accuracy") is not None]
        picked[actors] = {m["round"]: sorted((r["cid"], r["accuracy"]) for r in rows if r["round"] == m["round"])
                          for m in metrics}
        for m in metrics:
            mine = [r for r in rows if r["round"] == m["round"]]
            assert len(mine) == 4
            assert m["local_accuracy"] == pytest.approx(sum(r["accuracy"] * r["num_samples"] for r in mine)
                                                        / sum(r["num_samples"] for r in mine))
        assert json.loads((d / "summary.json").read_text())["local_eval_clients"] == 4
    assert picked[1] == picked[2] and sorted(picked[1]) == [2, 4]
    assert [c for c, _ in picked[1][2]] != [c for c, _ in picked[1][4]]  # drawn afresh each evaluation
