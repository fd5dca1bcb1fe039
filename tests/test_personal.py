"""Personalised FL (issue 44): FedPer, FedRep, LG-FedAvg, Ditto, APFL, FedBABU and fine-tuned
evaluation, against their definitions on models small enough to follow by hand (a 2-3-2
MLP, full-batch steps), then in real runs: personal state across actors and a resume."""
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from raysim.config import ConfigError, load_config
from raysim.run import main
from raysim.testing import InProcessServer
from raysim.training import cpu_state

X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]])
Y = torch.tensor([0, 1, 1, 0])
SMALL = ["num_clients=3", "clients_per_round=3", "model=mlp", "model_options.hidden=[3]", "local.momentum=0",
         "local.weight_decay=0", "local.lr=0.5", "local.batch_size=4", "local.epochs=1"]
BN = [o for o in SMALL if not o.startswith("model")] + ["model=mlp_bn", "plugins=[bn_model]"]  # tests/support/bn_model.py


def server_for(algorithm: str, *more: str) -> InProcessServer:
    cfg = load_config(overrides=[f"algorithm={algorithm}", *SMALL, *more])
    s = InProcessServer(cfg, [(X, Y), (X, 1 - Y), (X[:2], Y[:2])], 2)
    s.setup()
    return s


def keys(state: dict, part: str) -> set:
    return {k for k in state if k.startswith(part + ".")}


def ce(params: dict, x=X, y=Y):
    """Cross-entropy of the 2-3-2 MLP with these parameters (ReLU between)."""
    h = F.relu(x @ params["encoder.1.weight"].T + params["encoder.1.bias"])
    return F.cross_entropy(h @ params["head.weight"].T + params["head.bias"], y)


def grads(params: dict, which=None) -> dict:
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    names = list(which or p)
    return dict(zip(names, torch.autograd.grad(ce(p), [p[k] for k in names])))


@pytest.mark.parametrize("algorithm,shared,kept", [("fedper", "encoder", "head"), ("fedrep", "encoder", "head"),
                                                   ("lg_fedavg", "head", "encoder")])
def test_the_kept_part_never_leaves_the_client_and_the_shared_part_is_averaged(algorithm, shared, kept):
    s = server_for(algorithm)
    start = cpu_state(s.algorithm.model)
    payload = s.algorithm.broadcast(1)
    assert set(payload["weights"]) == keys(start, shared)  # only the shared part goes down
    ups = list(s.run_clients(1, [0, 1, 2], payload))
    assert all(set(r.update) == keys(start, shared) for r in ups)  # ... and up
    assert all(set(s.states[c]["kept"]) == keys(start, kept) for c in range(3))  # the rest stays home
    s.algorithm.aggregate(1, iter(ups))
    now = cpu_state(s.algorithm.model)
    n = [4, 4, 2]
    for k in keys(start, shared):  # the sample-weighted mean of the uploads
        mean = sum(r.update[k].double() * w for r, w in zip(ups, n)) / 10
        assert torch.allclose(now[k].double(), mean, atol=1e-6)
    assert all(torch.equal(now[k], start[k]) for k in keys(start, kept))  # the server's copy never moves
    # round 2: client 0 trains from its own part (hand-set here), not the server's: one
    # full-batch step of the whole model from (the served shared part, the client's part);
    # FedRep: the head first, then the encoder with the new head
    own = {k: s.states[0]["kept"][k] + 0.25 for k in keys(start, kept)}
    s.states[0]["kept"] = dict(own)
    (r2,) = s.run_clients(2, [0], s.algorithm.broadcast(2))
    p = {**{k: now[k] for k in keys(start, shared)}, **own}
    if algorithm == "fedrep":
        g = grads(p, sorted(keys(start, "head")))
        p = {**p, **{k: p[k] - 0.5 * g[k] for k in g}}
        g = grads(p, sorted(keys(start, "encoder")))
    else:
        g = grads(p)
    want = {**p, **{k: p[k] - 0.5 * g[k] for k in g}}
    for k in keys(start, shared):
        assert torch.allclose(r2.update[k], want[k], atol=1e-6), k
    for k in keys(start, kept):
        assert torch.allclose(s.states[0]["kept"][k], want[k], atol=1e-6), k


def test_fedrep_trains_the_head_with_the_encoder_fixed_then_the_encoder_with_the_head_fixed():
    """Full batch (4 samples, batch 4), 2 head epochs then 1 encoder epoch, lr 0.5: by hand,
    head1 = head0 - lr g_head(enc0, head0), head2 = head1 - lr g_head(enc0, head1),
    enc1 = enc0 - lr g_enc(enc0, head2)."""
    s = server_for("fedrep", "fedrep.head_epochs=2")
    p = cpu_state(s.algorithm.model)
    for _ in range(2):
        g = grads(p, ["head.weight", "head.bias"])
        p = {**p, **{k: p[k] - 0.5 * g[k] for k in g}}
    g = grads(p, ["encoder.1.weight", "encoder.1.bias"])
    want = {**p, **{k: p[k] - 0.5 * g[k] for k in g}}
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    assert (r.metrics["head_steps"], r.metrics["steps"]) == (2, 1)
    for k in ("encoder.1.weight", "encoder.1.bias"):
        assert torch.allclose(r.update[k], want[k], atol=1e-6)
    for k in ("head.weight", "head.bias"):
        assert torch.allclose(s.states[0]["kept"][k], want[k], atol=1e-6)


def test_ditto_personal_step_is_the_proximal_gradient_step_towards_the_received_global():
    """v1 = v0 - lr (grad f(v0) + lambda (v0 - w)), from a hand-set v0 != w; the upload is
    FedAvg's step from w."""
    s = server_for("ditto", "ditto.lam=2.0")
    w = cpu_state(s.algorithm.model)
    v0 = {k: t + 0.3 * torch.ones_like(t) for k, t in w.items()}
    s.states[0] = {"v": v0}
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    gv, gw = grads(v0), grads(w)
    for k in w:
        assert torch.allclose(s.states[0]["v"][k], v0[k] - 0.5 * (gv[k] + 2.0 * (v0[k] - w[k])), atol=1e-6)
        assert torch.allclose(r.update[k], w[k] - 0.5 * gw[k], atol=1e-6)


def apfl_round(*more: str):
    """APFL's round 1 on client 0 from the initial w, a hand-set v = w - 0.2 and alpha 0.3:
    (server, w, v, its result)."""
    s = server_for("apfl", *more)
    w = cpu_state(s.algorithm.model)
    v = {k: t - 0.2 * torch.ones_like(t) for k, t in w.items()}
    s.states[0] = {"v": v, "alpha": 0.3}
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    return s, w, v, r


@pytest.mark.parametrize("variant", ["paper", "pfllib"])
def test_apfl_updates_w_v_and_alpha_by_its_formulas(variant):
    """One full-batch step from w, a hand-set v and alpha = 0.3. The paper: g = grad f(v_bar)
    at v_bar = alpha v + (1 - alpha) w; v1 = v - lr alpha g; alpha1 = alpha - lr <v - w, g>;
    w1 = w - lr grad f(w). PFLlib: v1 = v - lr grad f(v); alpha1 = alpha - lr (<v1 - w1,
    alpha grad f(v) + (1 - alpha) grad f(w)> + 0.02 alpha); v kept as the mixture."""
    s, w, v, r = apfl_round(f"apfl.variant={variant}")
    gw = grads(w)
    w1 = {k: w[k] - 0.5 * gw[k] for k in w}
    if variant == "paper":
        g = grads({k: 0.3 * v[k] + 0.7 * w[k] for k in w})
        v1 = {k: v[k] - 0.5 * 0.3 * g[k] for k in w}
        alpha1 = 0.3 - 0.5 * float(sum(((v[k] - w[k]) * g[k]).sum() for k in w))
    else:
        gv = grads(v)
        v1 = {k: v[k] - 0.5 * gv[k] for k in w}
        alpha1 = 0.3 - 0.5 * (float(sum(((v1[k] - w1[k]) * (0.3 * gv[k] + 0.7 * gw[k])).sum() for k in w)) + 0.02 * 0.3)
    alpha1 = min(max(alpha1, 0.0), 1.0)
    assert s.states[0]["alpha"] == pytest.approx(alpha1, abs=1e-6)
    if variant == "pfllib":  # PFLlib keeps the mixture as the next v
        v1 = {k: alpha1 * v1[k] + (1 - alpha1) * w1[k] for k in w}
    for k in w:
        assert torch.allclose(r.update[k], w1[k], atol=1e-6)
        assert torch.allclose(s.states[0]["v"][k], v1[k], atol=1e-6)
    # its personal model. The paper: alpha v + (1 - alpha) w, w the served global model.
    # PFLlib: v as it is (clientapfl.test_metrics tests model_per, the mixture already): not mixed twice
    served = {k: t + 0.1 for k, t in w.items()}
    s.algorithm.model.load_state_dict(served)
    (p,) = s.run_clients(1, [0], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    for k in w:
        want = v1[k] if variant == "pfllib" else alpha1 * v1[k] + (1 - alpha1) * served[k]
        assert torch.allclose(p.update[k], want, atol=1e-6), k


def test_fedbabu_never_trains_the_head_and_fine_tunes_it_for_evaluation():
    s = server_for("fedbabu", "fedbabu.finetune_epochs=2")
    start = cpu_state(s.algorithm.model)
    for rnd in (1, 2):
        s.round(rnd)
    now = cpu_state(s.algorithm.model)
    assert all(torch.equal(now[k], start[k]) for k in keys(start, "head"))  # at its random start
    assert not torch.equal(now["encoder.1.weight"], start["encoder.1.weight"])  # the body learns
    (p,) = s.run_clients(3, [0], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    assert not torch.equal(p.update["head.weight"], now["head.weight"])  # fine-tuned, head too
    assert p.metrics["steps"] == 2


def test_fine_tuned_evaluation_trains_from_the_served_model_on_the_clients_data_and_leaves_its_state():
    s = server_for("scaffold", "eval.finetune_epochs=1", "partition.test_fraction=0.2")
    s.round(1)
    before = {c: dict(st) for c, st in s.states.items()}
    w = cpu_state(s.algorithm.model)
    (p,) = s.run_clients(1, [0], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    assert p.metrics["steps"] == 1
    g = grads(w)  # one full-batch step of plain SGD from the served model
    assert all(torch.allclose(p.update[k], w[k] - 0.5 * g[k], atol=1e-6) for k in w)
    assert all(torch.equal(s.states[c][k], before[c][k]) for c in before for k in before[c] if torch.is_tensor(before[c][k]))


def _model(path):
    return torch.load(path / "model.pt", weights_only=True)["global"]


@pytest.mark.parametrize("algorithm", ["fedper", "apfl"])
def test_personal_runs_are_bit_identical_across_actors_and_resume_and_beat_the_global_model(
        ray_local, tmp_path, algorithm):
    """digits, 20 clients with two labels each, a fifth of each client's samples its own test
    split: the same run on 1 and 3 actors, and stopped after round 3 then resumed, gives the
    same model and personal accuracies bit for bit (the personal parts live in client state);
    each client's own model beats the global one on its own labels."""
    common = ["dataset=digits", "model=mlp", "model_options.hidden=[32]", "num_clients=20", "clients_per_round=10",
              "partition=classes", "partition.k=2", "partition.test_fraction=0.2", "local.lr=0.05",
              f"algorithm={algorithm}", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=6", "resources.num_actors=1", "run_name=one"]) == 0
    fedavg = [*[c for c in common if not c.startswith("algorithm=")], "algorithm=fedavg", "rounds=6", "run_name=fedavg"]
    assert main(fedavg) == 0
    assert main([*common, "rounds=6", "resources.num_actors=3", "run_name=three"]) == 0
    assert main([*common, "rounds=3", "resources.num_actors=2", "checkpoint_every=3", "run_name=half"]) == 0
    assert main(["--quiet", f"resume={tmp_path / 'half'}", "rounds=6"]) == 0
    one = _model(tmp_path / "one")
    for other in ("three", "half"):
        m = _model(tmp_path / other)
        assert all(torch.equal(one[k], m[k]) for k in one), other
    rows = {r: pq.read_table(tmp_path / r / "metrics.parquet").to_pylist() for r in ("one", "three", "half")}
    last = rows["one"][-1]
    assert last["personal_accuracy"] == rows["three"][-1]["personal_accuracy"] == rows["half"][-1]["personal_accuracy"]
    # each client's own model beats FedAvg's global model on the clients' own test data
    served = pq.read_table(tmp_path / "fedavg" / "metrics.parquet").to_pylist()[-1]["local_accuracy"]
    assert last["personal_accuracy"] > served + 0.1, (last, served)
    clients = pq.read_table(tmp_path / "one" / "clients.parquet").to_pylist()
    assert sum(c["method"] == "evaluate_personal" for c in clients) == 20 * len([r for r in rows["one"]
                                                                                 if r.get("personal_accuracy")])
    assert all(r["clients"] == 10 for r in rows["one"])  # evaluation calls are not the round's clients


def test_fine_tuned_evaluation_needs_clients_with_test_data(ray_local, tmp_path, capsys):
    assert main(["dataset=digits", "num_clients=5", "rounds=1", "eval.finetune_epochs=1",
                 f"output_dir={tmp_path}", "run_name=r", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "eval.finetune_epochs" in err and "partition.test_fraction" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_fine_tuning_a_model_no_client_trains_is_refused():
    from raysim.config import ConfigError

    with pytest.raises(ConfigError, match="eval.finetune_epochs: algorithm 'fedconcat'"):
        load_config(overrides=["algorithm=fedconcat", "eval.finetune_epochs=1"])


# ---- issue 54: what the reference audit found ------------------------------------------------------


def test_a_personalised_run_tests_its_clients_own_models_unless_told_otherwise():
    """A run of FedPer with no partition.test_fraction gets local test splits (said in the
    log), so that its accuracy is the clients' models', not the server's model with its
    initial head; an explicit 0 is refused in one line. Ditto's global model is FedAvg's:
    it may run without them."""
    from raysim.config import ConfigError, describe_layers, read_layers, resolve

    layers = read_layers((), ["algorithm=fedper"])
    cfg = resolve(layers)
    assert cfg.partition.test_fraction == 0.2
    assert any("partition.test_fraction=0.2" in line for line in describe_layers(layers, cfg))
    assert load_config(overrides=["algorithm=fedper", "partition.test_fraction=0.1"]).partition.test_fraction == 0.1
    assert load_config(overrides=["algorithm=fedavg"]).partition.test_fraction == 0
    assert load_config(overrides=["algorithm=ditto", "partition.test_fraction=0"]).partition.test_fraction == 0
    for algorithm, part in (("fedper", "head"), ("lg_fedavg", "encoder"), ("fedbabu", "head")):
        with pytest.raises(ConfigError, match=f"partition.test_fraction=0: algorithm '{algorithm}' .* initial {part}"):
            load_config(overrides=[f"algorithm={algorithm}", "partition.test_fraction=0"])


def test_the_cli_never_reports_the_servers_random_head_as_the_methods_accuracy(ray_local, tmp_path, capsys):
    assert main(["dataset=digits", "algorithm=fedper", "model=mlp", "model_options.hidden=[32]", "num_clients=10",
                 "clients_per_round=5", "partition=classes", "partition.k=2", "rounds=2", "local.lr=0.05",
                 f"output_dir={tmp_path}", "run_name=r", "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    final = [line for line in lines if line.startswith("final accuracy")]
    assert len(final) == 1 and final[0].startswith("final accuracy of the clients' own models"), lines
    assert "the server's model (the shared part with the initial head, no client's model)" in final[0]
    summary = __import__("json").loads((tmp_path / "r" / "summary.json").read_text())
    assert f"{summary['final_personal_accuracy']:.4f}" in final[0].split(";")[0]
    assert "test_fraction: 0.2" in (tmp_path / "r" / "config.yaml").read_text()


def test_apfl_trains_through_the_shared_training_loop():
    """local.steps bounds APFL's steps (w, v and alpha alike); a one-sample batch is skipped
    on a model with BatchNorm (client 2 has 3 samples, batch 2); v takes w's momentum: two
    full-batch steps of PFLlib's reading, by hand, v2 = v1 - lr (g(v1) + 0.9 g(v0))."""
    s = server_for("apfl", "local.steps=1", "local.batch_size=2")
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
    assert r.metrics["steps"] == 1

    cfg = load_config(overrides=["algorithm=apfl", *BN, "local.batch_size=2"])
    bn = InProcessServer(cfg, [(X, Y), (X, 1 - Y), (X[:3], Y[:3])], 2)
    bn.setup()
    (r,) = bn.run_clients(1, [2], bn.algorithm.broadcast(1))
    assert r.metrics["steps"] == 1  # the batch of one is not trained on
    assert "encoder.2.running_mean" in bn.states[2]["v"]  # v keeps BatchNorm statistics of its own

    s, w, v, r = apfl_round("apfl.variant=pfllib", "local.epochs=2", "local.momentum=0.9")
    g0 = grads(v)
    v1 = {k: v[k] - 0.5 * g0[k] for k in v}
    g1 = grads(v1)
    v2 = {k: v1[k] - 0.5 * (g1[k] + 0.9 * g0[k]) for k in v}
    a = s.states[0]["alpha"]
    assert 0.05 < a < 1
    for k in w:  # PFLlib keeps alpha v2 + (1 - alpha) w2 as v
        assert torch.allclose(s.states[0]["v"][k], a * v2[k] + (1 - a) * r.update[k], atol=1e-5), k


BN_DATA = [(torch.cat([X, X]), torch.cat([Y, Y])), (X[:2], Y[:2])]  # 8 and 2 samples: 4 and 1 steps of batch 2


def bn_server(algorithm: str, buffers: str) -> InProcessServer:
    cfg = load_config(overrides=[f"algorithm={algorithm}", *BN, "num_clients=2", "clients_per_round=2",
                                 "local.batch_size=2", f"personal.buffers={buffers}"])
    s = InProcessServer(cfg, BN_DATA, 2)
    s.setup()
    return s


@pytest.mark.parametrize("algorithm", ["fedper", "fedrep", "ditto", "apfl", "fedbabu"])  # LG-FedAvg: BatchNorm is in its kept encoder
def test_buffers_of_the_shared_part_are_averaged_or_stay_on_the_client(algorithm):
    """BatchNorm's batch counter tells whose statistics a client trained from: client 1 trains
    1 step a round, client 0 4. `shared`: the server's statistics are the plain weighted mean
    of the clients' (the counter: the largest), and client 1 starts round 2 from them (4 + 1
    batches). `local` (FedBN's and PFLlib's rule): nothing of them goes down, client 1 goes on
    from its own (1 + 1), its personal model carries them, and the server's own copy is still
    the uploads' mean."""
    key = "encoder.2.num_batches_tracked"
    bn = {"encoder.2.running_mean", "encoder.2.running_var", key}
    for buffers in ("shared", "local"):
        s = bn_server(algorithm, buffers)
        assert key in s.algorithm.shared_keys
        ups = list(s.run_clients(1, [0, 1], s.algorithm.broadcast(1)))
        s.algorithm.aggregate(1, iter(ups))
        now = cpu_state(s.algorithm.model)
        c0, c1 = int(ups[0].update[key]), int(ups[1].update[key])  # batches counted (FedRep's head epochs too)
        assert c0 > c1 > 0
        for k in ("encoder.2.running_mean", "encoder.2.running_var"):
            mean = (ups[0].update[k].double() * 8 + ups[1].update[k].double() * 2) / 10
            assert torch.allclose(now[k].double(), mean, atol=1e-6), (buffers, k)
        assert int(now[key]) == c0
        sent = set(s.algorithm.broadcast(2)["weights"])
        assert (sent & bn == set()) == (buffers == "local"), (buffers, sent)
        (r,) = s.run_clients(2, [1], s.algorithm.broadcast(2))
        assert int(r.update[key]) == (2 * c1 if buffers == "local" else c0 + c1), buffers
        if buffers == "local" and algorithm in ("fedper", "fedrep"):  # its model: the served one made its own
            own = s.states[1]["buffers"]
            (p,) = s.run_clients(2, [1], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
            assert all(torch.equal(p.update[k], own[k]) for k in own)


def test_fedbabu_fine_tunes_at_a_fraction_of_the_training_lr():
    """`fedbabu.finetune_lr=0.01` (the authors' setting): one full-batch step at lr 0.5 x 0.01."""
    s = server_for("fedbabu", "fedbabu.finetune_epochs=1", "fedbabu.finetune_lr=0.01")
    w = cpu_state(s.algorithm.model)
    (p,) = s.run_clients(1, [0], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    g = grads(w)
    assert all(torch.allclose(p.update[k], w[k] - 0.005 * g[k], atol=1e-7) for k in w)


def test_apfl_trains_on_augmented_batches(ray_local, tmp_path):
    """`local.augment` reaches APFL's training (it used to train on the raw batches): the same
    run with and without crop-and-flip gives another model (v trains on the same batches as
    w: one loop, `local_sgd`'s)."""
    common = ["dataset=digits", "model=mlp", "model_options.hidden=[16]", "num_clients=4", "clients_per_round=4",
              "rounds=1", "algorithm=apfl", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "run_name=plain"]) == 0
    assert main([*common, "run_name=aug", "local.augment=crop_flip"]) == 0
    plain, aug = _model(tmp_path / "plain"), _model(tmp_path / "aug")
    assert any(not torch.equal(plain[k], aug[k]) for k in plain)


def test_pfedme_refuses_an_inner_step_that_cannot_be_stable_and_notes_momentum():
    """theta's step scales (theta - w) by 1 - personal_lr x lam: at personal_lr x lam >= 2 it
    grows whatever the loss, refused in one line; a w step with momentum, which the authors'
    code does not have, is noted in the config's log."""
    from raysim.config import describe_layers, read_layers, resolve

    with pytest.raises(ConfigError, match=r"pfedme.personal_lr x pfedme.lam must be under 2 .* got 0.2 x 15.0 = 3"):
        load_config(overrides=["algorithm=pfedme", "pfedme.personal_lr=0.2"])
    notes = lambda *o: describe_layers(read_layers((), ["algorithm=pfedme", *o]),  # noqa: E731
                                       resolve(read_layers((), ["algorithm=pfedme", *o])))
    assert any("local.momentum=0.9 applies to w's step" in line for line in notes())
    assert not any("local.momentum" in line for line in notes("local.momentum=0"))


def test_lg_fedavg_warm_start_is_fedavg_on_the_whole_model_then_lg_from_the_warm_encoder():
    """lg_fedavg.warm_rounds (the authors start LG-FedAvg from a FedAvg model, main_lg.py
    --load_fed): rounds 1..N are FedAvg's own, bit for bit, with nothing kept on the clients;
    in round N + 1 a client starts from the warm encoder, keeps what it trains, and the
    server's encoder stays the warm one while its head moves."""
    import torch

    from raysim.config import load_config
    from raysim.testing import InProcessServer

    common = ["dataset=digits", "model=mlp", "model_options.hidden=[16]", "num_clients=4", "participation=0.5",
              "partition.test_fraction=0.2"]
    lg = InProcessServer.from_config(load_config(overrides=["algorithm=lg_fedavg", "lg_fedavg.warm_share=0.5", "rounds=4",
                                                            *common]))
    fa = InProcessServer.from_config(load_config(overrides=["algorithm=fedavg", *common]))
    lg.setup()
    fa.setup()
    for rnd in (1, 2):
        lg.round(rnd)
        fa.round(rnd)
    warm = {k: v.clone() for k, v in lg.algorithm.model.state_dict().items()}
    assert all(torch.equal(warm[k], v) for k, v in fa.algorithm.model.state_dict().items())
    assert not any("kept" in s for s in lg.states.values())
    lg.round(3)
    cohort = lg.select_clients(3)
    after = lg.algorithm.model.state_dict()
    assert all(torch.equal(after[k], warm[k]) for k in after if k.startswith("encoder."))  # never averaged
    assert not torch.equal(after["head.weight"], warm["head.weight"])
    sent = lg.algorithm.broadcast(4)  # what a client without an encoder of its own starts from: the warm one
    assert sent["warm"] is False and all(torch.equal(sent["weights"][k], warm[k]) for k in warm if k.startswith("encoder."))
    for c in cohort:  # each kept the encoder it trained
        kept = lg.states[c]["kept"]
        assert set(kept) == {k for k in after if k.startswith("encoder.")}
        assert not torch.equal(kept["encoder.1.weight"], warm["encoder.1.weight"])
