"""CReFF (issue 13) against its definition: per-class gradients, the matching loss, the
federated features in checkpoints."""
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from raysim.contract import Client
from raysim.algorithms.creff import CReFF, class_gradients, linear_ce_gradients, matching_loss
from raysim.config import load_config
from raysim.models import build_model
from raysim.run import main


def test_a_clients_class_gradient_is_autograd_of_the_mean_cross_entropy_of_that_class():
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    head = torch.nn.Linear(model.feature_dim, 10)
    x, y = torch.randn(30, 1, 8, 8), torch.tensor([3] * 12 + [7] * 18)
    grads = class_gradients(model, head, x, y)
    assert sorted(grads) == [3, 7]  # the classes it holds only
    for c in (3, 7):
        loss = F.cross_entropy(head(model.encoder(x[y == c])), y[y == c])  # mean over that class's samples
        gw, gb = torch.autograd.grad(loss, [head.weight, head.bias])
        assert torch.allclose(grads[c][0], gw, atol=1e-6) and torch.allclose(grads[c][1], gb, atol=1e-6)
    # the server's closed form for features is the same gradient
    feats = torch.randn(2, 5, model.feature_dim)
    fw, fb = linear_ce_gradients(head.weight, head.bias, feats, torch.tensor([3, 7]))
    gw, gb = torch.autograd.grad(F.cross_entropy(head(feats[1]), torch.full((5,), 7)), [head.weight, head.bias])
    assert torch.allclose(fw[1], gw, atol=1e-6) and torch.allclose(fb[1], gb, atol=1e-6)


def test_the_matching_loss_is_zero_for_identical_gradients_and_falls_over_the_feature_steps():
    torch.manual_seed(1)
    g = (torch.randn(10, 6), torch.randn(10))
    assert float(matching_loss(g, g)) < 1e-5 and float(matching_loss(g, g, "sum")) < 1e-5
    assert abs(float(matching_loss(g, (-g[0], -g[1]), "mean")) - 2.0) < 1e-5  # opposite: 1 - (-1) per row
    cfg = load_config(overrides=["algorithm=creff", "creff.features_per_class=8", "creff.match_steps=50"])
    algo = CReFF(cfg, 10, (6,))
    algo.classifier = torch.nn.Linear(6, 10)
    algo.features = torch.randn(80, 6)
    target_feats = torch.randn(2, 8, 6) + 2.0  # the "real" gradients come from other features of classes 1 and 4
    tw, tb = linear_ce_gradients(algo.classifier.weight.detach(), algo.classifier.bias.detach(), target_feats,
                                 torch.tensor([1, 4]))
    before = algo.features.clone()
    first, last = algo.match_features({1: (tw[0], tb[0]), 4: (tw[1], tb[1])})
    assert last < first
    assert torch.equal(algo.features[:8], before[:8])  # classes without a target keep their features
    assert not torch.equal(algo.features[8:16], before[8:16])


def test_creff_resumes_with_its_federated_features_to_the_same_model(ray_local, tmp_path):
    common = ["algorithm=creff", "long_tail.imbalance=10", "creff.features_per_class=10", "creff.match_steps=10",
              "creff.retrain_steps=20", "local.epochs=1", "checkpoint_every=2", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=2", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "--quiet"]) == 0
    assert main([*common, "rounds=4", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("part", "whole"))
    assert torch.equal(a["features"], b["features"]) and torch.equal(a["classifier"]["weight"], b["classifier"]["weight"])
    assert all(torch.equal(a["global"][k], b["global"][k]) for k in a["global"])
    rows = pq.read_table(tmp_path / "whole" / "metrics.parquet").to_pylist()
    assert all(r["match_loss"] < r["match_loss_start"] for r in rows)
    assert "global_accuracy" in rows[0] and "few_accuracy" in rows[0]


def test_ccvr_pools_the_clients_gaussians_exactly_and_samples_them_within_sampling_error():
    import numpy as np

    from raysim.algorithms.ccvr import pooled_gaussians

    rng = np.random.default_rng(0)
    data = {0: rng.normal([1, -2, 0.5], [1, 2, 0.5], (300, 3)), 1: rng.normal(3, 1, (200, 3))}
    # three clients hold uneven shares of each class
    cuts = {0: [0, 40, 250, 300], 1: [0, 1, 120, 200]}
    stats = []
    for k in range(3):
        mine = {}
        for c, x in data.items():
            part = x[cuts[c][k]:cuts[c][k + 1]]
            cov = np.cov(part.T) if len(part) > 1 else np.zeros((3, 3))
            mine[c] = (len(part), part.mean(0), cov)
        stats.append(mine)
    pooled = pooled_gaussians(stats, 3)
    for c, x in data.items():  # the pooled statistics are those of all the class's samples
        assert np.allclose(pooled[c][0], x.mean(0)) and np.allclose(pooled[c][1], np.cov(x.T))
    draws = np.random.default_rng(1).multivariate_normal(*pooled[0], 20000, method="eigh")
    assert np.allclose(draws.mean(0), pooled[0][0], atol=0.05) and np.allclose(np.cov(draws.T), pooled[0][1], atol=0.1)


def test_ccvr_calibrates_the_classifier_on_virtual_features_and_resumes(ray_local, tmp_path):
    common = ["algorithm=ccvr", "long_tail.imbalance=10", "ccvr.retrain_steps=50", "local.epochs=1",
              "checkpoint_every=2", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=2", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=3", "--quiet"]) == 0
    assert main([*common, "rounds=3", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("part", "whole"))
    assert torch.equal(a["calibrated"]["weight"], b["calibrated"]["weight"])
    rows = pq.read_table(tmp_path / "whole" / "clients.parquet").to_pylist()
    assert sum(r["method"] == "feature_stats" for r in rows) == 3 * 20  # every client, every round
