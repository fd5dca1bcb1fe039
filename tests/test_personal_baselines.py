"""The personalised baselines of issue 56 (FedBN, ...) against their definitions on models
small enough to follow by hand, then in real runs: they learn on digits and give the same
bits on any number of actors, in process and resumed."""
import pytest
import torch

from raysim.config import ConfigError, load_config
from raysim.run import main
from raysim.testing import InProcessServer
from raysim.training import cpu_state
from test_personal import BN, BN_DATA, SMALL, X, Y, grads, server_for  # noqa: F401  (the 2-3-2 MLP and its data)

NORM = {"encoder.2.weight", "encoder.2.bias", "encoder.2.running_mean", "encoder.2.running_var",
        "encoder.2.num_batches_tracked"}  # mlp_bn's BatchNorm layer (tests/support/bn_model.py)


def test_fedbn_keeps_every_batchnorm_layer_on_its_client_and_averages_the_rest():
    """mlp_bn: Flatten, Linear, BatchNorm1d, ReLU | head. Nothing of the BatchNorm layer goes
    down or up; each client's stays in its state (weight and bias trained, statistics
    counted); the server averages the rest by samples and keeps its initial BatchNorm layer;
    round 2, a client trains from the served weights with its own BatchNorm layer."""
    cfg = load_config(overrides=["algorithm=fedbn", *BN, "num_clients=2", "clients_per_round=2", "local.batch_size=2"])
    s = InProcessServer(cfg, BN_DATA, 2)
    s.setup()
    start = cpu_state(s.algorithm.model)
    assert s.algorithm.shared_keys == set(start) - NORM
    payload = s.algorithm.broadcast(1)
    assert set(payload["weights"]) == set(start) - NORM
    ups = list(s.run_clients(1, [0, 1], payload))
    assert all(set(r.update) == set(start) - NORM for r in ups)
    for c, steps in ((0, 4), (1, 1)):
        own = s.states[c]["kept"]
        assert set(own) == NORM and int(own["encoder.2.num_batches_tracked"]) == steps
        assert not torch.equal(own["encoder.2.weight"], start["encoder.2.weight"])  # trained, not only counted
    s.algorithm.aggregate(1, iter(ups))
    now = cpu_state(s.algorithm.model)
    for k in set(start) - NORM:
        mean = (ups[0].update[k].double() * 8 + ups[1].update[k].double() * 2) / 10
        assert torch.allclose(now[k].double(), mean, atol=1e-6), k
    assert all(torch.equal(now[k], start[k]) for k in NORM)
    # round 2: client 1's model is the served one with its own BatchNorm layer (hand-set here)
    mine = {k: v.clone() for k, v in s.states[1]["kept"].items()}
    mine["encoder.2.weight"] = mine["encoder.2.weight"] * 0 + 2.0
    s.states[1]["kept"] = mine
    (p,) = s.run_clients(2, [1], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    assert all(torch.equal(p.update[k], mine[k]) for k in NORM)
    assert all(torch.equal(p.update[k], now[k]) for k in set(start) - NORM)
    (r,) = s.run_clients(2, [1], s.algorithm.broadcast(2))
    assert int(s.states[1]["kept"]["encoder.2.num_batches_tracked"]) == 2


def test_fedbn_gives_a_model_with_a_norm_option_batchnorm_and_refuses_one_without(tmp_path, capsys):
    """`algorithm=fedbn` alone: the default mlp gets `norm=batch` (said in the log); a model
    set to no normalisation, or with no BatchNorm at all, is one line naming those that have it."""
    from raysim.config import describe_layers, read_layers, resolve

    layers = read_layers((), ["algorithm=fedbn"])
    cfg = resolve(layers)
    assert cfg.model == "mlp" and cfg.model_options.norm == "batch"
    assert any("model_options.norm=batch" in line for line in describe_layers(layers, cfg))
    assert resolve(read_layers((), ["algorithm=fedbn", "model=resnet8"])).model_options == {}
    for model in (["model=mlp", "model_options.norm=none"], ["model=mclr"]):
        assert main(["algorithm=fedbn", "dataset=digits", *model, "rounds=1", f"output_dir={tmp_path}",
                     "run_name=r", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "keeps each client's BatchNorm layers, but model=" in err and "has none" in err, err
        assert "resnet8" in err and "Traceback" not in err and not (tmp_path / "r").exists()


# (algorithm, its model, overrides for learning, the personal accuracy its last 3 rounds reach on digits)
LEARNS = [("fedbn", ["model=resnet8"], ["partition=dirichlet", "partition.beta=0.5", "rounds=8", "local.lr=0.1"], 0.75),
          ("perfedavg", ["model=mlp", "perfedavg.beta=0.2"], ["participation=1.0", "rounds=10"], 0.85),
          ("pfedme", ["model=mlp"], ["participation=1.0", "rounds=10"], 0.8),
          ("fedrod", ["model=mlp"], ["rounds=8"], 0.85),
          ("fedproto", ["model=mlp"], ["participation=1.0", "rounds=6"], 0.9),
          ("fedala", ["model=mlp"], ["rounds=8"], 0.85)]


@pytest.mark.parametrize("algorithm,model,learn,reaches", LEARNS, ids=[a[0] for a in LEARNS])
def test_learns_on_digits_and_gives_the_same_bits_on_any_actors_and_resumed(ray_local, tmp_path, algorithm, model,
                                                                            learn, reaches):
    """digits, 10 clients with two labels each, half a round: the same model on 2 actors and
    in process, and the same model and personal accuracy stopped after round 2 then resumed; then
    each client's own model learns (a Dirichlet split, a few rounds more)."""
    from same_bits import same_bits_on_ray_and_in_process
    import pyarrow.parquet as pq

    common = [f"algorithm={algorithm}", "dataset=digits", *model, "num_clients=10", "participation=0.5",
              "partition=classes", "partition.k=2", "rounds=4", "local.lr=0.05"]
    models, _ = same_bits_on_ray_and_in_process(tmp_path, common, (2,))
    assert main([*common, "rounds=2", "checkpoint_every=2", f"output_dir={tmp_path}", "run_name=part", "--quiet"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "--quiet"]) == 0
    resumed = torch.load(tmp_path / "part" / "model.pt", weights_only=True)["global"]
    assert all(torch.equal(models[0][k], resumed[k]) for k in resumed)
    last = {r: pq.read_table(tmp_path / r / "metrics.parquet").to_pylist()[-1]["personal_accuracy"]
            for r in ("a2", "part")}
    assert last["a2"] == last["part"], last
    assert main([*common, *learn, f"output_dir={tmp_path}", "run_name=learn", "--quiet"]) == 0
    curve = [r["personal_accuracy"] for r in pq.read_table(tmp_path / "learn" / "metrics.parquet").to_pylist()]
    last = sum(curve[-3:]) / 3
    assert last > reaches and last > curve[0] + 0.05, curve


# ---- Per-FedAvg ----------------------------------------------------------------------------------
def _grad(params: dict, x, y) -> dict:
    from test_personal import ce

    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    return dict(zip(p, torch.autograd.grad(ce(p, x, y), list(p.values()))))


def _client(cfg, model, x=X, y=Y, cid=0):
    from raysim.training import new_client

    return new_client(cfg, 1, cid, x, y, 2, {}, model, epochs=1)


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_meta_gradient_is_the_papers(variant):
    """On one batch split into D, D' (and D''): w_tmp = w - alpha g(w; D); v = g(w_tmp; D');
    fo: the loss's gradient w.r.t. w is v; hf: v - alpha [g(w + dv; D'') - g(w - dv; D'')] / 2d,
    close to v - alpha H(w; D'') v by autograd's exact Hessian-vector product. Its value:
    f(w_tmp; D')."""
    from raysim.algorithms.perfedavg import PerFedAvg
    from test_personal import ce

    s = server_for("perfedavg", f"perfedavg.variant={variant}", "local.batch_size=2", "perfedavg.delta=0.0001")
    algo, model = s.algorithm, s.algorithm.model
    w = cpu_state(model)
    x = torch.cat([X, X[:2] * 2]) if variant == "hf" else X  # 6 samples for D, D', D''
    y = torch.cat([Y, Y[:2]]) if variant == "hf" else Y
    loss = PerFedAvg.meta_loss(algo, _client(s.cfg, model, x, y))(model, x, y)
    model.zero_grad()
    loss.backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    alpha = 0.5
    g = _grad(w, x[:2], y[:2])
    tmp = {k: w[k] - alpha * g[k] for k in w}
    v = _grad(tmp, x[2:4], y[2:4])
    assert float(loss.detach()) == pytest.approx(float(ce(tmp, x[2:4], y[2:4])), abs=1e-6)
    want = v
    if variant == "hf":
        d = 1e-4
        plus = _grad({k: w[k] + d * v[k] for k in w}, x[4:], y[4:])
        minus = _grad({k: w[k] - d * v[k] for k in w}, x[4:], y[4:])
        want = {k: v[k] - alpha * (plus[k] - minus[k]) / (2 * d) for k in w}
        names = list(w)
        _, hv = torch.autograd.functional.hvp(lambda *t: ce(dict(zip(names, t)), x[4:], y[4:]),
                                              tuple(w[k] for k in names), tuple(v[k] for k in names))
        exact = {k: v[k] - alpha * h for k, h in zip(names, hv)}
        assert all(torch.allclose(want[k], exact[k], atol=2e-3) for k in w)
        assert any(not torch.allclose(want[k], v[k], atol=1e-4) for k in w)  # the Hessian term is there
    for k in w:
        assert torch.allclose(got[k], want[k], atol=1e-5), k


def test_perfedavg_steps_from_w_with_beta_and_adapts_one_step_at_alpha_for_evaluation():
    """One meta step (local.steps=1, batches of 2 x 2 in the client's permutation) moves w by
    beta times the meta-gradient, from w (not from w_tmp: PFLlib's second step); the client's
    personal model is the served w after one full-batch step at alpha on its training data."""
    from raysim.seeds import seed_for

    s = server_for("perfedavg", "local.batch_size=2", "local.steps=1", "perfedavg.beta=0.2")
    w = cpu_state(s.algorithm.model)
    perm = torch.randperm(4, generator=torch.Generator().manual_seed(seed_for(int(s.cfg.seed), 1, 0)))
    x, y = X[perm], Y[perm]
    g = _grad(w, x[:2], y[:2])
    v = _grad({k: w[k] - 0.5 * g[k] for k in w}, x[2:], y[2:])
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    assert r.metrics["steps"] == 1
    for k in w:
        assert torch.allclose(r.update[k], w[k] - 0.2 * v[k], atol=1e-6), k
    full = server_for("perfedavg", "local.batch_size=8")
    w = cpu_state(full.algorithm.model)
    (p,) = full.run_clients(1, [0], full.algorithm.personal_payload("global", full.algorithm.model),
                            method="personalise")
    g = _grad(w, X, Y)
    assert p.metrics["steps"] == 1
    assert all(torch.allclose(p.update[k], w[k] - 0.5 * g[k], atol=1e-6) for k in w)


def test_perfedavgs_meta_step_is_plain_sgd_at_fedavgs_effective_step_by_default():
    """Both references' meta optimiser is plain SGD (FL-bench's `meta_optimizer`, PFLlib's
    PerAvgOptimizer): with local.momentum 0.9 and weight decay set, two meta steps (each a
    batch of 2 x 2: one pass over the 4 samples, a new permutation each) move w by beta =
    local.lr / (1 - local.momentum) (the step FedAvg's momentum SGD takes in effect; PFLlib's
    beta = lr at momentum 0: issue 85) times each meta-gradient, with no momentum carried from
    the first step to the second and no decay. (Before issue 71: beta 0.001 through the
    shared optimiser's momentum and decay.)"""
    from raysim.seeds import seed_for

    s = server_for("perfedavg", "local.batch_size=2", "local.steps=2", "local.momentum=0.9",
                   "local.weight_decay=0.01")
    w = cpu_state(s.algorithm.model)
    g = torch.Generator().manual_seed(seed_for(int(s.cfg.seed), 1, 0))
    for _ in range(2):  # each step is one whole batch of 4 = one pass: a new permutation each
        perm = torch.randperm(4, generator=g)
        x, y = X[perm], Y[perm]
        v = _grad({k: w[k] - 0.5 * _grad(w, x[:2], y[:2])[k] for k in w}, x[2:], y[2:])
        w = {k: w[k] - 0.5 / (1 - 0.9) * v[k] for k in w}
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    assert r.metrics["steps"] == 2 and r.metrics["lr"] == pytest.approx(5.0)
    for k in w:
        assert torch.allclose(r.update[k], w[k], atol=1e-6), k


def test_perfedavg_splits_a_short_batch_and_never_trains_on_one_sample():
    from raysim.algorithms.perfedavg import split

    assert split(8, 2, 4) == [slice(0, 4), slice(4, 8)]
    assert split(5, 2, 4) == [slice(0, 3), slice(3, 5)]
    assert split(3, 2, 4) == [slice(0, 2), slice(0, 2)]  # D' of one sample: D again
    assert split(7, 3, 4) == [slice(0, 3), slice(3, 6), slice(3, 6)]


# ---- pFedMe --------------------------------------------------------------------------------------
def test_pfedme_solves_the_moreau_envelopes_inner_problem_and_pulls_w_towards_theta():
    """Full-batch, 2 local rounds (epochs), K = 2: theta starts at w, each round
    theta <- theta - plr (g(theta) + lambda (theta - w)) twice, then w <- w - eta lambda (w - theta);
    theta carries over from round to round; the upload is w, the kept personal model theta."""
    s = server_for("pfedme", "pfedme.k=2", "pfedme.lam=3", "pfedme.personal_lr=0.1", "local.epochs=2",
                   "local.batch_size=8")
    w = cpu_state(s.algorithm.model)
    theta, eta = dict(w), 0.5
    for _ in range(2):
        for _ in range(2):
            g = _grad(theta, X, Y)
            theta = {k: theta[k] - 0.1 * (g[k] + 3 * (theta[k] - w[k])) for k in w}
        w = {k: w[k] - eta * 3 * (w[k] - theta[k]) for k in w}
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    for k in w:
        assert torch.allclose(r.update[k], w[k], atol=1e-5), k
        assert torch.allclose(s.states[0]["theta"][k], theta[k], atol=1e-5), k
    (p,) = s.run_clients(1, [0], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    assert all(torch.equal(p.update[k], s.states[0]["theta"][k]) for k in w)  # its model: theta
    (q,) = s.run_clients(1, [1], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    served = cpu_state(s.algorithm.model)
    assert all(torch.equal(q.update[k], served[k]) for k in w)  # never trained: the served model


def test_pfedme_server_mixes_the_mean_in_by_beta_and_buffers_take_the_plain_mean():
    """beta = 2: w+ = w + 2 (avg - w) on the weights; BatchNorm statistics: the plain
    sample-weighted mean (a running variance cannot be pushed below zero)."""
    cfg = load_config(overrides=["algorithm=pfedme", "pfedme.beta=2", *BN, "num_clients=2", "clients_per_round=2",
                                 "local.batch_size=2"])
    s = InProcessServer(cfg, BN_DATA, 2)
    s.setup()
    w = cpu_state(s.algorithm.model)
    ups = list(s.run_clients(1, [0, 1], s.algorithm.broadcast(1)))
    s.algorithm.aggregate(1, iter(ups))
    now = cpu_state(s.algorithm.model)
    params = {n for n, _ in s.algorithm.model.named_parameters()}
    for k in w:
        mean = (ups[0].update[k].double() * 8 + ups[1].update[k].double() * 2) / 10
        want = w[k].double() + 2 * (mean - w[k].double()) if k in params else mean
        if k.endswith("num_batches_tracked"):
            continue
        assert torch.allclose(now[k].double(), want, atol=1e-5), k
    with pytest.raises(ConfigError, match="server.optimizer"):
        load_config(overrides=["algorithm=pfedme", "server.optimizer=adam"])


# ---- FedRoD --------------------------------------------------------------------------------------
@pytest.mark.parametrize("labels,gamma,shift", [
    ([0, 1, 1, 1], 1.0, [0.0, 1.0986123]),  # the paper's BSM: log n_c, counts (1, 3)
    ([0, 1, 1, 1], 0.5, [0.0, 0.5493061]),  # 0.5 log 3
    ([1, 1, 1, 1], 1.0, [float("-inf"), 1.3862944]),  # class 0 absent: out of the softmax
    ([1, 1, 1, 1], 0.0, [0.0, 0.0])])  # gamma 0: plain cross-entropy, even with a class absent (was NaN)
def test_fedrod_trains_the_generic_head_on_balanced_softmax_and_its_own_head_on_the_sum(labels, gamma, shift):
    """Client 0 holds `labels`. One full-batch step at lr 0.5: the encoder and g on
    CE(g(z) + log n_c^gamma, y) (`shift`, worked out by hand); p on CE(g(z) + p(z), y) with
    g(z) and z fixed. The upload is the encoder and g; p stays home; its personal model's head
    is g + p."""
    import torch.nn.functional as F

    y0 = torch.tensor(labels)
    cfg = load_config(overrides=["algorithm=fedrod", *SMALL, "local.batch_size=8", f"fedrod.gamma={gamma}"])
    s = InProcessServer(cfg, [(X, y0), (X, 1 - Y), (X[:2], Y[:2])], 2)
    s.setup()
    w = cpu_state(s.algorithm.model)
    assert torch.equal(w["personal.weight"], w["head.weight"])  # p starts as a copy of the initial head
    p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    z = F.relu(X @ p["encoder.1.weight"].T + p["encoder.1.bias"])
    g = z @ p["head.weight"].T + p["head.bias"]
    bsm = F.cross_entropy(g + torch.tensor(shift), y0)
    own = F.cross_entropy(g.detach() + z.detach() @ p["personal.weight"].T + p["personal.bias"], y0)
    grad = dict(zip(p, torch.autograd.grad(bsm + own, list(p.values()))))
    want = {k: w[k] - 0.5 * grad[k] for k in w}
    assert s.algorithm.broadcast(1)["weights"].keys() == {k for k in w if not k.startswith("personal.")}
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    assert set(r.update) == {k for k in w if not k.startswith("personal.")}
    for k in r.update:
        assert torch.isfinite(r.update[k]).all() and torch.allclose(r.update[k], want[k], atol=1e-6), k
    for k in ("personal.weight", "personal.bias"):
        assert torch.allclose(s.states[0]["kept"][k], want[k], atol=1e-6), k
        assert not torch.allclose(want[k], w[k])
    served = cpu_state(s.algorithm.model)
    (q,) = s.run_clients(1, [0], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    for part in ("weight", "bias"):
        assert torch.allclose(q.update[f"head.{part}"], served[f"head.{part}"] + s.states[0]["kept"][f"personal.{part}"])
    assert torch.equal(q.update["encoder.1.weight"], served["encoder.1.weight"])


# ---- FedProto ------------------------------------------------------------------------------------
def test_fedproto_trains_towards_the_global_prototypes_and_uploads_its_class_means():
    """Client 0 (labels 0, 1, 1, 0) with a global prototype for class 1 only: one full-batch
    step at lr 0.5 on CE(head(z), y) + 2 MSE(z, target), target C^1 for the class-1 samples
    and z itself (no pull) for the others; nothing of the model goes up, only each class's
    mean z after training (eval mode) and its count; the model stays on the client."""
    import torch.nn.functional as F

    s = server_for("fedproto", "fedproto.lam=2", "local.batch_size=8")
    w = cpu_state(s.algorithm.model)
    c1 = torch.tensor([0.5, -0.25, 1.0])
    s.algorithm.protos[1], s.algorithm.has[1] = c1, True
    p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    z = F.relu(X @ p["encoder.1.weight"].T + p["encoder.1.bias"])
    target = torch.where((Y == 1)[:, None], c1.expand(4, 3), z.detach())
    loss = F.cross_entropy(z @ p["head.weight"].T + p["head.bias"], Y) + 2 * F.mse_loss(z, target)
    grad = dict(zip(p, torch.autograd.grad(loss, list(p.values()))))
    want = {k: w[k] - 0.5 * grad[k] for k in w}
    payload = s.algorithm.broadcast(1)
    assert payload["weights"] == {}
    (r,) = s.run_clients(1, [0], payload)
    assert set(r.update) == {"protos", "counts"}
    for k in w:
        assert torch.allclose(s.states[0]["kept"][k], want[k], atol=1e-6), k
    z1 = F.relu(X @ want["encoder.1.weight"].T + want["encoder.1.bias"])
    assert torch.allclose(r.update["protos"], torch.stack([z1[Y == 0].mean(0), z1[Y == 1].mean(0)]), atol=1e-6)
    assert r.update["counts"].tolist() == [2, 2]


def test_fedproto_can_collect_its_prototypes_from_the_last_epochs_training_passes():
    """`fedproto.collect=training` (the authors'): 2 epochs of batches of 2 at lr 0.5; the
    prototypes are the mean z of epoch 2's batches, each z taken before its step, so they are
    neither the trained model's (collect=after) nor epoch 1's."""
    import torch.nn.functional as F

    s = server_for("fedproto", "fedproto.collect=training", "local.batch_size=2", "local.epochs=2")
    w = cpu_state(s.algorithm.model)
    client = s._client(1, 0, False)  # its batch order, as local_sgd draws it
    order = [torch.randperm(4, generator=client.generator) for _ in range(2)]
    p, zs = dict(w), []
    for epoch, perm in enumerate(order):
        for rows in (perm[:2], perm[2:]):
            q = {k: v.clone().requires_grad_(True) for k, v in p.items()}
            z = F.relu(X[rows] @ q["encoder.1.weight"].T + q["encoder.1.bias"])
            if epoch == 1:
                zs.append((z.detach(), Y[rows]))
            loss = F.cross_entropy(z @ q["head.weight"].T + q["head.bias"], Y[rows])
            p = {k: p[k] - 0.5 * g for k, g in zip(q, torch.autograd.grad(loss, list(q.values())))}
    z2, y2 = torch.cat([z for z, _ in zs]), torch.cat([y for _, y in zs])
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    assert torch.allclose(r.update["protos"], torch.stack([z2[y2 == 0].mean(0), z2[y2 == 1].mean(0)]), atol=1e-6)
    after = F.relu(X @ p["encoder.1.weight"].T + p["encoder.1.bias"])
    assert not torch.allclose(r.update["protos"], torch.stack([after[Y == 0].mean(0), after[Y == 1].mean(0)]),
                              atol=1e-4)


@pytest.mark.parametrize("weighting", ["clients", "samples"])
def test_fedproto_server_averages_each_classs_prototypes_over_the_clients_that_hold_it(weighting):
    from raysim.contract import ClientResult

    s = server_for("fedproto", f"fedproto.weighting={weighting}")
    t = torch.tensor
    ups = [ClientResult(0, 4, {"protos": t([[1.0, 0, 0], [2.0, 2, 2]]), "counts": t([1.0, 3])}, {"loss": 1.0}),
           ClientResult(1, 6, {"protos": t([[3.0, 0, 0], [0.0, 0, 0]]), "counts": t([6.0, 0])}, {"loss": 1.0})]
    s.algorithm.aggregate(1, iter(ups))
    c0 = t([2.0, 0, 0]) if weighting == "clients" else t([(1.0 + 18) / 7, 0, 0])
    assert torch.allclose(s.algorithm.protos[0], c0) and torch.allclose(s.algorithm.protos[1], t([2.0, 2, 2]))
    assert s.algorithm.has.tolist() == [True, True]
    s.algorithm.aggregate(2, iter(ups[1:]))  # the round's uploads replace the last round's
    assert s.algorithm.has.tolist() == [True, False]
    assert torch.allclose(s.algorithm.protos[0], t([3.0, 0, 0])) and not s.algorithm.protos[1].any()


def test_fedproto_can_keep_the_last_prototype_of_a_class_the_rounds_clients_lack():
    """`fedproto.absent=keep`: class 1, held by no client of round 2, keeps round 1's prototype;
    class 0 takes round 2's."""
    from raysim.contract import ClientResult

    s = server_for("fedproto", "fedproto.absent=keep")
    t = torch.tensor
    s.algorithm.aggregate(1, iter([ClientResult(0, 4, {"protos": t([[1.0, 0, 0], [2.0, 2, 2]]), "counts": t([1.0, 3])},
                                                {"loss": 1.0})]))
    s.algorithm.aggregate(2, iter([ClientResult(1, 6, {"protos": t([[3.0, 0, 0], [0.0, 0, 0]]), "counts": t([6.0, 0])},
                                                {"loss": 1.0})]))
    assert s.algorithm.has.tolist() == [True, True]
    assert torch.allclose(s.algorithm.protos[0], t([3.0, 0, 0])) and torch.allclose(s.algorithm.protos[1], t([2.0, 2, 2]))


def test_fedproto_predicts_by_the_nearest_global_prototype():
    s = server_for("fedproto")
    s.round(1)
    s.algorithm.protos = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.5, 0.0]])
    s.algorithm.has = torch.tensor([True, True])
    (p,) = s.run_clients(2, [0], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    model = s.algorithm.build_model((2,))
    model.load_state_dict(p.update)
    model.eval()
    z = model.encoder(X).detach()
    nearest = torch.cdist(z, s.algorithm.protos).argmin(1)
    assert torch.equal(model(X).argmax(1), nearest)
    assert torch.equal(p.update["encoder.1.weight"], s.states[0]["kept"]["encoder.1.weight"])  # its own encoder
    s.algorithm.has = torch.tensor([True, False])  # a class no client holds is never predicted
    (p,) = s.run_clients(2, [0], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    model.load_state_dict(p.update)
    assert (model(X).argmax(1) == 0).all()


# ---- FedALA --------------------------------------------------------------------------------------
def _ala_by_hand(glob: dict, own: dict, W: dict, passes: int, eta: float = 1.0,
                 batches=(slice(0, 2), slice(2, 4))) -> tuple[dict, dict]:
    """The head mixed: theta_hat = own + (glob - own) W, W stepped on `batches` of X in
    order; the encoder the global one. (the mixed model, W)."""
    from test_personal import ce

    W = dict(W)
    mixed = lambda: {**glob, **{k: own[k] + (glob[k] - own[k]) * W[k] for k in W}}  # noqa: E731
    for _ in range(passes):
        for rows in batches:
            p = {k: v.clone().requires_grad_(k in W) for k, v in mixed().items()}
            g = dict(zip(W, torch.autograd.grad(ce(p, X[rows], Y[rows]), [p[k] for k in W])))
            W = {k: torch.clamp(W[k] - eta * g[k] * (glob[k] - own[k]), 0, 1) for k in W}
    return mixed(), W


def test_fedala_mixes_the_head_element_wise_with_learned_weights_and_takes_the_global_encoder():
    """layer_idx 2 (the head's weight and bias), all of the data in order, batches of 2: a
    client with its theta and W (hand-set) is evaluated with one pass of W's learning, by
    hand; its state is untouched by evaluation and updated by training; the first time
    (no W) passes repeat until the std test passes (here: 2 passes)."""
    s = server_for("fedala", "local.batch_size=2", "fedala.rand_percent=100", "fedala.eta=0.7")
    glob = cpu_state(s.algorithm.model)
    own = {k: v + 0.3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in glob.items()}
    W = {"head.weight": torch.full((2, 3), 0.5), "head.bias": torch.tensor([0.2, 0.9])}
    s.states[0] = {"theta": own, "W": list(W.values())}
    want, W1 = _ala_by_hand(glob, own, W, passes=1, eta=0.7)
    payload = s.algorithm.personal_payload("global", s.algorithm.model)
    (p,) = s.run_clients(1, [0], payload, method="personalise")
    for k in glob:
        assert torch.allclose(p.update[k], want[k], atol=1e-6), k
    assert torch.equal(s.states[0]["W"][0], W["head.weight"])  # evaluation leaves the state as it was
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    assert all(torch.allclose(a, W1[k], atol=1e-6) for a, k in zip(s.states[0]["W"], W))
    assert all(torch.equal(s.states[0]["theta"][k], r.update[k]) for k in glob)  # its trained model stays
    # the first time ALA runs: W from ones, passes until the std of the last loss is under 1e9 (2 passes)
    s2 = server_for("fedala", "local.batch_size=2", "fedala.rand_percent=100", "fedala.num_pre_loss=1",
                    "fedala.threshold=1e9")
    s2.states[0] = {"theta": own}
    ones = {k: torch.ones_like(v) for k, v in W.items()}
    _, W2 = _ala_by_hand(glob, own, ones, passes=2)
    s2.run_clients(1, [0], s2.algorithm.broadcast(1))
    assert all(torch.allclose(a, W2[k], atol=1e-6) for a, k in zip(s2.states[0]["W"], W))
    # never trained: the served model as it is
    (q,) = s.run_clients(1, [1], payload, method="personalise")
    assert all(torch.equal(q.update[k], glob[k]) for k in glob)


def test_fedalas_window_starts_anywhere_and_keeps_its_last_short_batch():
    """rand_percent 75 of 4 samples: a window of 3 from a random start (0 or 1), cut in batches
    of 2: rows [a, a+2) then the short [a+2, a+3), kept as the authors' DataLoader
    (drop_last=False) keeps it. The learned W is one of the two hand computations; dropping
    the short batch (raysim before issue 71) matches neither."""
    s = server_for("fedala", "local.batch_size=2", "fedala.rand_percent=75", "fedala.eta=0.7")
    glob = cpu_state(s.algorithm.model)
    own = {k: v + 0.3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in glob.items()}
    W = {"head.weight": torch.full((2, 3), 0.5), "head.bias": torch.tensor([0.2, 0.9])}
    s.states[0] = {"theta": own, "W": list(W.values())}
    s.run_clients(1, [0], s.algorithm.broadcast(1))
    got = dict(zip(W, s.states[0]["W"]))
    hand = [_ala_by_hand(glob, own, W, passes=1, eta=0.7, batches=(slice(a, a + 2), slice(a + 2, a + 3)))[1]
            for a in (0, 1)]
    dropped = [_ala_by_hand(glob, own, W, passes=1, eta=0.7, batches=(slice(a, a + 2),))[1] for a in (0, 1)]
    assert any(all(torch.allclose(got[k], h[k], atol=1e-6) for k in W) for h in hand)
    assert not any(all(torch.allclose(got[k], h[k], atol=1e-6) for k in W) for h in dropped)


def test_perfedavg_and_fedproto_say_when_a_measured_default_fails_the_run_and_only_then():
    """Per-FedAvg: a meta step not above the adaptation step (beta null is local.lr / (1 -
    local.momentum)); FedProto:
    the authors' absent-class rule with fewer clients a round than the population."""
    from raysim.config import load_config
    from raysim.registry import ALGORITHMS

    def notes(name: str, *overrides) -> str:
        return " ".join(ALGORITHMS.get(name).config_notes(load_config(overrides=[f"algorithm={name}", *overrides])))

    assert "set perfedavg.beta above local.lr" in notes("perfedavg", "local.lr=0.1", "local.momentum=0")  # beta = lr
    assert "perfedavg.beta above" not in notes("perfedavg", "local.lr=0.1")  # beta = lr / (1 - 0.9) = 1
    assert "set perfedavg.beta above local.lr" in notes("perfedavg", "local.lr=0.1", "perfedavg.beta=0.05")
    assert "perfedavg.beta above" not in notes("perfedavg", "local.lr=0.01", "perfedavg.beta=0.1")
    assert "fedproto.absent=keep" in notes("fedproto", "participation=0.5")
    assert not notes("fedproto", "participation=1.0") and not notes("fedproto", "fedproto.absent=keep")
