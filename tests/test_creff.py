"""CReFF (issue 13, 45) against its definition and its reference: per-class gradients (exact
and the reference's augmented draws), the matching loss, the re-training's start and length,
the federated features in checkpoints; CCVR's post-hoc calibration."""
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from raysim.algorithms.creff import (CReFF, class_gradients, linear_ce_gradients, matching_loss, retrain_steps,
                                     sampled_class_gradients)
from raysim.config import load_config
from raysim.data.dsa import AUGMENTS, OPS, siamese_augment
from raysim.models import build_model
from raysim.run import main
from raysim.seeds import seed_for


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


def test_creff_resumes_and_repacks_to_the_same_bits_with_its_augmented_draws(ray_local, tmp_path):
    """The reference's sampled, augmented gradients come from (seed, round, client): a run
    on 3 actors stopped after round 2 and resumed equals one run on 1 actor, bit for bit."""
    common = ["algorithm=creff", "long_tail.imbalance=10", "creff.features_per_class=10", "creff.match_steps=10",
              "creff.retrain_epochs=2", "creff.gradient_draws=2", "local.epochs=1", "checkpoint_every=2",
              f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=2", "run_name=part", "resources.num_actors=3"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "--quiet"]) == 0
    assert main([*common, "rounds=4", "run_name=whole", "resources.num_actors=1"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("part", "whole"))
    assert torch.equal(a["features"], b["features"]) and torch.equal(a["classifier"]["weight"], b["classifier"]["weight"])
    assert all(torch.equal(a["global"][k], b["global"][k]) for k in a["global"])
    rows = pq.read_table(tmp_path / "whole" / "metrics.parquet").to_pylist()
    assert all(r["match_loss"] < r["match_loss_start"] for r in rows)
    assert "global_accuracy" in rows[0] and "few_accuracy" in rows[0]


def test_the_sampled_gradient_is_the_exact_one_for_one_whole_unaugmented_draw_and_else_an_estimate():
    torch.manual_seed(2)
    model = build_model("cnn", (1, 28, 28), 10)
    head = torch.nn.Linear(model.feature_dim, 10)
    x, y = torch.randn(40, 1, 28, 28), torch.tensor([2] * 25 + [5] * 15)
    exact = class_gradients(model, head, x, y)
    whole = sampled_class_gradients(model, head, x, y, 1, 32, "none", torch.Generator().manual_seed(0))
    for c in (2, 5):  # every sample of the class in one draw: the mean gradient itself
        assert torch.allclose(whole[c][0], exact[c][0], atol=1e-6) and torch.allclose(whole[c][1], exact[c][1], atol=1e-6)
    strategy = "color_crop_cutout_flip_scale_rotate"
    one, again, other = (sampled_class_gradients(model, head, x, y, 10, 8, strategy, torch.Generator().manual_seed(s))
                         for s in (7, 7, 8))
    assert all(torch.equal(one[c][0], again[c][0]) for c in (2, 5))  # the generator decides everything
    assert not torch.equal(one[2][0], other[2][0]) and not torch.equal(one[2][0], exact[2][0])
    assert F.cosine_similarity(one[2][0].flatten(), exact[2][0].flatten(), dim=0) > 0.5  # an estimate of it


def test_every_dsa_op_is_siamese_deterministic_and_keeps_the_shape():
    x = torch.randn(6, 3, 16, 16)
    for op in OPS:
        out = AUGMENTS[op](x, torch.Generator().manual_seed(3))
        assert out.shape == x.shape and torch.equal(out, AUGMENTS[op](x, torch.Generator().manual_seed(3)))
        # Siamese: one draw of parameters for the whole batch, so each sample is transformed
        # as it would be alone with the same draw
        alone = torch.cat([AUGMENTS[op](x[i:i + 1], torch.Generator().manual_seed(3)) for i in range(len(x))])
        assert torch.allclose(out, alone, atol=1e-6), op
    # crop is a shift by at most 2 pixels (1/8 of 16) each way, zeros where the image left
    out = AUGMENTS["crop"](x, torch.Generator().manual_seed(5))
    assert sum(torch.equal(out, _shifted(x, dy, dx)) for dy in range(-2, 3) for dx in range(-2, 3)) == 1
    # cutout zeroes one square of at most half the side (clipped at the borders), nothing else
    out = AUGMENTS["cutout"](x, torch.Generator().manual_seed(5))
    zero = (out == 0).all(dim=(0, 1))
    rows, cols = zero.any(1).nonzero().flatten(), zero.any(0).nonzero().flatten()
    assert 1 <= len(rows) <= 8 and 1 <= len(cols) <= 8 and int(zero.sum()) == len(rows) * len(cols)
    assert torch.equal(out[:, :, ~zero], x[:, :, ~zero])
    # the batch op: one op drawn per call from the strategy's; 'none' leaves x alone
    seen = {tuple(siamese_augment(x, "flip_crop", torch.Generator().manual_seed(s))[0, 0, 0, :3].tolist())
            for s in range(20)}
    assert len(seen) > 1
    assert siamese_augment(x, "none", torch.Generator().manual_seed(0)) is x


def _shifted(x, dy, dx):
    """out[i, j] = x[i + dy, j + dx], zero outside."""
    h, w = x.shape[2:]
    out = torch.zeros_like(x)
    for i in range(h):
        for j in range(w):
            if 0 <= i + dy < h and 0 <= j + dx < w:
                out[:, :, i, j] = x[:, :, i + dy, j + dx]
    return out


@pytest.mark.parametrize("start", ["fresh", "aggregated"])
def test_the_retraining_takes_epochs_times_batches_steps_from_its_start(start):
    """3 epochs of 15 features in batches of 4: 3 x 4 = 12 steps (the last batch of 3 kept),
    from a new seeded nn.Linear (fresh: whatever the aggregated classifier is) or from a copy
    of the aggregated one; the server's torch generator untouched."""
    assert retrain_steps(1000, 32, 300) == 9600  # the reference's 300 epochs at m = 100, C = 10
    cfg = load_config(overrides=["algorithm=creff", "creff.features_per_class=5", "creff.retrain_epochs=3",
                                 "creff.retrain_batch=4", "creff.retrain_lr=0.05", f"creff.retrain_start={start}"])
    algo = CReFF(cfg, 3, (1, 8, 8))
    algo.model = build_model("mlp", (1, 8, 8), 3)
    d = algo.model.feature_dim
    algo.features, algo.labels = torch.randn(15, d), torch.arange(3).repeat_interleave(5)
    before = torch.get_rng_state()
    algo.retrain(rnd=4)
    assert torch.equal(torch.get_rng_state(), before)
    if start == "fresh":  # by hand
        torch.manual_seed(seed_for(int(cfg.seed), 4, 45))
        head = torch.nn.Linear(d, 3)
    else:
        head = torch.nn.Linear(d, 3)
        head.load_state_dict(algo.model.head.state_dict())
    g = torch.Generator().manual_seed(seed_for(int(cfg.seed), 4, 46))
    steps = 0
    for _ in range(3):
        perm = torch.randperm(15, generator=g)
        for i in range(0, 15, 4):
            idx = perm[i:i + 4]
            gw, gb = torch.autograd.grad(F.cross_entropy(head(algo.features[idx]), algo.labels[idx]),
                                         [head.weight, head.bias])
            with torch.no_grad():
                head.weight -= 0.05 * gw
                head.bias -= 0.05 * gb
            steps += 1
    assert steps == 12
    assert torch.allclose(algo.classifier.weight, head.weight, atol=1e-6)
    assert torch.allclose(algo.classifier.bias, head.bias, atol=1e-6)
    with torch.no_grad():
        algo.model.head.weight.add_(1.0)
    algo.retrain(rnd=4)
    moved = not torch.allclose(algo.classifier.weight, head.weight, atol=1e-6)
    assert moved == (start == "aggregated")  # fresh never reads the aggregated classifier


def test_ccvr_pools_the_clients_gaussians_exactly_and_samples_them_within_sampling_error():

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
    from raysim.algorithms.ccvr import virtual_features

    x, y = virtual_features(pooled, 20000, np.random.default_rng(1))
    assert x.dtype == torch.float32 and torch.equal(y, torch.tensor([0] * 20000 + [1] * 20000))
    for c in (0, 1):  # the virtual samples have the pooled class's mean and covariance
        v = x[y == c].double().numpy()
        assert np.allclose(v.mean(0), pooled[c][0], atol=0.05) and np.allclose(np.cov(v.T), pooled[c][1], atol=0.1)


def test_ccvr_calibrates_once_after_the_last_round_and_only_the_classifier(ray_local, tmp_path):
    """The paper's CCVR: rounds are FedAvg's to the bit; after the last, every client's
    statistics once, a calibrated head on the FedAvg encoder as the run's final result; a
    run stopped and resumed calibrates the same."""
    common = ["long_tail.imbalance=10", "local.epochs=1", "checkpoint_every=2", "partition.test_fraction=0.2",
              f"output_dir={tmp_path}", "--quiet"]
    ccvr = ["algorithm=ccvr", "ccvr.retrain_steps=50"]
    assert main([*ccvr, *common, "rounds=2", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=3", "--quiet"]) == 0
    assert main([*ccvr, *common, "rounds=3", "run_name=whole"]) == 0
    assert main(["algorithm=fedavg", *common, "rounds=3", "run_name=fedavg"]) == 0
    part, whole, fedavg = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("part", "whole", "fedavg"))
    assert torch.equal(part["calibrated"]["weight"], whole["calibrated"]["weight"])
    assert all(torch.equal(whole["global"][k], fedavg["global"][k]) for k in fedavg["global"])  # FedAvg's model
    assert not torch.equal(whole["calibrated"]["weight"], whole["global"]["head.weight"])  # the head calibrated
    calls = pq.read_table(tmp_path / "whole" / "clients.parquet").to_pylist()
    stats = [r for r in calls if r["method"] == "feature_stats"]
    assert len(stats) == 20 and {r["round"] for r in stats} == {3}  # once, every client, after the last round
    rows = {n: pq.read_table(tmp_path / n / "metrics.parquet").to_pylist() for n in ("whole", "fedavg")}
    assert [r["accuracy"] for r in rows["whole"]] == [r["accuracy"] for r in rows["fedavg"]]  # per round: FedAvg's
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["final_accuracy"] == summary["after_training"]["calibrated"]["accuracy"]
    assert summary["final_round_accuracy"] == rows["fedavg"][-1]["accuracy"]
    assert "final_few_accuracy" in summary
    # the clients' own test splits are served by the model the run ends with, the calibrated one
    # (they read the last round's FedAvg model before: the table's per-client column for CCVR)
    fedavg_summary = json.loads((tmp_path / "fedavg" / "summary.json").read_text())
    assert summary["final_round_local_accuracy"] == fedavg_summary["final_local_accuracy"]
    assert summary["final_local_accuracy"] != summary["final_round_local_accuracy"]


def test_ccvr_every_round_is_the_variant_that_calibrates_each_round():
    from raysim.testing import InProcessServer

    rng = torch.Generator().manual_seed(0)
    clients = [(torch.randn(30, 1, 8, 8, generator=rng), torch.arange(30) % 3) for _ in range(4)]
    test = (torch.randn(30, 1, 8, 8, generator=rng), torch.arange(30) % 3)
    for mode, per_round in (("every_round", True), ("final", False)):
        cfg = load_config(overrides=["algorithm=ccvr", "model=mlp", "num_clients=4", "participation=0.5",
                                     "rounds=2", f"ccvr.calibrate={mode}", "ccvr.retrain_steps=5"])
        server = InProcessServer(cfg, clients, 3, test=test)
        metrics = server.run()
        assert ("calibrated_classes" in metrics[-1]) == per_round
        final = server.finish()
        assert list(final) == ([] if per_round else ["calibrated"])
        stats_rounds = [r for r, method, _ in server.calls if method == "feature_stats"]
        assert stats_rounds == ([1, 2] if per_round else [2])
