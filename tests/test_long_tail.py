"""Long-tailed training sets and many / medium / few-shot accuracy (issue 13)."""
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from raysim.config import ConfigError, load_config
from raysim.data.long_tail import long_tail_index, profile, shot_accuracy, shot_groups
from raysim.experiment import prepare
from raysim.run import main


def test_the_profile_has_the_requested_imbalance_factor_and_decays_exponentially():
    n = profile(50000, 10, 100)
    assert n[0] == 5000 and n[-1] == 50 and n[0] / n[-1] == 100  # CIFAR-10-LT, IF=100
    ratios = n[:-1] / n[1:]
    assert np.allclose(ratios, 100 ** (1 / 9), rtol=0.01)
    y = np.repeat(np.arange(10), 5000)
    kept = long_tail_index(y, 10, 100, np.random.default_rng(0))
    assert np.bincount(y[kept]).tolist() == n.tolist()


def test_a_long_tailed_dataset_keeps_its_test_set_balanced():
    base, lt = (prepare(load_config(overrides=o))[0] for o in ([], ["long_tail.imbalance=10"]))
    counts = np.bincount(lt.y_train, minlength=10)
    assert counts[0] >= 9 * counts[-1] and (np.diff(counts) <= 0).all()
    assert np.array_equal(lt.y_test, base.y_test) and np.array_equal(lt.x_test, base.x_test)
    with pytest.raises(ConfigError, match="long_tail.imbalance must be >= 1"):
        load_config(overrides=["long_tail.imbalance=0.5"])


def test_shot_groups_and_their_accuracy_on_a_hand_made_case():
    train = np.array([2000, 1600, 1500, 600, 200, 199, 50])
    groups = shot_groups(train, [1500, 200])
    assert {k: v.tolist() for k, v in groups.items()} == {"many": [0, 1], "medium": [2, 3, 4], "few": [5, 6]}
    per_class = [1.0, 0.5, 0.9, 0.6, 0.3, 0.2, 0.0]
    test = np.array([100, 300, 100, 100, 200, 100, 300])
    got = shot_accuracy(per_class, test, groups)
    assert got["many_accuracy"] == pytest.approx((100 * 1.0 + 300 * 0.5) / 400)  # correct / test samples of the group
    assert got["medium_accuracy"] == pytest.approx((90 + 60 + 60) / 400)
    assert got["few_accuracy"] == pytest.approx(20 / 400)


def test_every_run_on_long_tailed_data_reports_the_shot_groups(ray_local, tmp_path):
    assert main(["long_tail.imbalance=20", "eval.shots=[100,20]", "rounds=2", f"output_dir={tmp_path}", "run_name=lt",
                 "--quiet"]) == 0
    row = pq.read_table(tmp_path / "lt" / "metrics.parquet").to_pylist()[-1]
    assert all(row[f"{g}_accuracy"] is not None for g in ("many", "medium", "few"))
    summary = json.loads((tmp_path / "lt" / "summary.json").read_text())
    assert summary["final_few_accuracy"] == row["few_accuracy"]


def test_tau_norm_with_tau_1_gives_unit_norm_classifier_rows_and_leaves_the_model_alone():
    import torch

    from raysim.models import build_model
    from raysim.training import tau_normalised

    model = build_model("mlp", (1, 8, 8), 10)
    before = model.head.weight.detach().clone()
    normed = tau_normalised(model, 1.0)
    assert torch.allclose(torch.linalg.vector_norm(normed.head.weight, dim=1), torch.ones(10))
    assert torch.equal(model.head.weight, before) and torch.equal(normed.head.bias, model.head.bias)
    half = tau_normalised(model, 0.5).head.weight
    assert torch.allclose(half, before / torch.linalg.vector_norm(before, dim=1, keepdim=True) ** 0.5)
    assert tau_normalised(model, 0.0) is model


def test_focal_loss_is_cross_entropy_at_gamma_0_and_down_weights_easy_samples():
    import torch

    from raysim.training import cross_entropy, focal_loss

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    assert torch.allclose(focal_loss(0.0)(model, x, y), cross_entropy(model, x, y))
    p = torch.softmax(model(x), 1)[torch.arange(8), y]
    assert torch.allclose(focal_loss(2.0)(model, x, y), (-(1 - p) ** 2 * p.log()).mean())


@pytest.mark.parametrize("gamma", [0.5, 2.0])
def test_focal_loss_gradients_stay_finite_when_a_sample_is_fitted_to_probability_one(gamma):
    """A margin of 200 makes float32's p_y exactly 1: below gamma = 1 the gradient of
    (1 - p)^gamma was inf x 0 = NaN there (Fed-Focal diverged at gamma 0.5). Now it is
    finite, the fitted sample contributes no gradient, and the loss is unchanged."""
    import torch

    from raysim.training import focal_per_sample

    logits = torch.tensor([[200.0, 0.0, 0.0], [0.3, 0.1, -0.2]], requires_grad=True)
    y = torch.tensor([0, 1])
    assert torch.softmax(logits, 1)[0, 0].item() == 1.0
    loss = focal_per_sample(gamma)(logits, y)
    loss.sum().backward()
    assert torch.isfinite(logits.grad).all() and torch.equal(logits.grad[0], torch.zeros(3))
    p = torch.softmax(logits.detach(), 1)[1, 1]
    assert torch.allclose(loss[1], -(1 - p) ** gamma * p.log()) and loss[0].item() == 0.0


def test_fedfocal_and_fedavg_taunorm_run_and_eval_tau_norm_applies_to_any_algorithm(ray_local, tmp_path):
    import torch

    common = ["long_tail.imbalance=10", "rounds=2", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "algorithm=fedfocal", "run_name=focal"]) == 0
    assert main([*common, "algorithm=fedavg_taunorm", "run_name=tn"]) == 0
    assert main([*common, "algorithm=fedavg", "eval.tau_norm=1", "run_name=evaltn"]) == 0
    a, b = (pq.read_table(tmp_path / n / "metrics.parquet").to_pylist() for n in ("tn", "evaltn"))
    assert [r["accuracy"] for r in a] == [r["accuracy"] for r in b]  # the same model, the same normalisation
    saved = torch.load(tmp_path / "tn" / "model.pt", weights_only=True)["global"]["head.weight"]
    assert not torch.allclose(torch.linalg.vector_norm(saved, dim=1), torch.ones(10))  # the trained model is saved


def test_local_focal_gamma_swaps_the_plain_loss_of_any_algorithm_that_trains_on_it():
    import torch

    from raysim.contract import Client
    from raysim.algorithms.fedprox import FedProx
    from raysim.models import build_model
    from raysim.training import focal_loss

    cfg = load_config(overrides=["algorithm=fedprox", "fedprox.mu=0.5", "local.focal_gamma=2"])
    model = build_model("mlp", (1, 8, 8), 10)
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    client = Client(0, 1, cfg, x, y, 10, torch.device("cpu"), torch.Generator(), {}, model)
    weights = {k: v + 0.1 for k, v in model.state_dict().items()}
    loss = FedProx(cfg, 10, (1, 8, 8)).local_loss(client, {"weights": weights})(model, x, y)
    prox = sum(((p - weights[n]) ** 2).sum() for n, p in model.named_parameters())
    assert torch.allclose(loss, focal_loss(2.0)(model, x, y) + 0.25 * prox)
    with pytest.raises(ConfigError, match="local.focal_gamma: algorithm 'fedrs' trains on its own loss"):
        load_config(overrides=["algorithm=fedrs", "local.focal_gamma=2"])
