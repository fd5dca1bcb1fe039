"""Personalised FL (issue 44): FedPer, FedRep, LG-FedAvg, Ditto, APFL, FedBABU and fine-tuned
evaluation, against their definitions on models small enough to follow by hand (a 2-3-2
MLP, full-batch steps), then in real runs: personal state across actors and a resume."""
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from raysim.config import load_config
from raysim.run import main
from raysim.testing import InProcessServer
from raysim.training import cpu_state

X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]])
Y = torch.tensor([0, 1, 1, 0])
SMALL = ["num_clients=3", "clients_per_round=3", "model=mlp", "model_options.hidden=[3]", "local.momentum=0",
         "local.weight_decay=0", "local.lr=0.5", "local.batch_size=4", "local.epochs=1"]


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
    # round 2: each client resumes from its own part, not the server's
    ups2 = list(s.run_clients(2, [0], s.algorithm.broadcast(2)))
    assert ups2[0].update.keys() == ups[0].update.keys()
    assert not torch.equal(s.states[0]["kept"][sorted(keys(start, kept))[0]], start[sorted(keys(start, kept))[0]])


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


@pytest.mark.parametrize("variant", ["paper", "pfllib"])
def test_apfl_updates_w_v_and_alpha_by_its_formulas(variant):
    """One full-batch step from w, a hand-set v and alpha = 0.3. The paper: g = grad f(v_bar)
    at v_bar = alpha v + (1 - alpha) w; v1 = v - lr alpha g; alpha1 = alpha - lr <v - w, g>;
    w1 = w - lr grad f(w). PFLlib: v1 = v - lr grad f(v); alpha1 = alpha - lr (<v1 - w1,
    alpha grad f(v) + (1 - alpha) grad f(w)> + 0.02 alpha); v kept as the mixture."""
    s = server_for("apfl", f"apfl.variant={variant}")
    w = cpu_state(s.algorithm.model)
    v = {k: t - 0.2 * torch.ones_like(t) for k, t in w.items()}
    s.states[0] = {"v": v, "alpha": 0.3}
    (r,) = s.run_clients(1, [0], s.algorithm.broadcast(1))
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
    # its personal model: alpha v + (1 - alpha) w, w the served global
    (p,) = s.run_clients(1, [0], s.algorithm.personal_payload("global", s.algorithm.model), method="personalise")
    for k in w:
        assert torch.allclose(p.update[k], alpha1 * s.states[0]["v"][k] + (1 - alpha1) * w[k], atol=1e-6)


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
    s = server_for("scaffold", "eval.finetune_epochs=1")
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
    assert last["personal_accuracy"] > last["local_accuracy"] + 0.1, last
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
