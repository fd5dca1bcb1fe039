"""SCAFFOLD, FedNova, MOON, FedRS and FedLC against their definitions in ALGORITHMS.md,
on models and tensors small enough to follow by hand."""
import math

import numpy as np
import torch
import torch.nn.functional as F

from raysim.algorithms.fedavg import FedAvg
from raysim.algorithms.fedlc import calibrated_logits
from raysim.algorithms.fednova import FedNova
from raysim.algorithms.fedrs import FedRS, logit_scale
from raysim.algorithms.moon import Moon, contrastive_loss, with_projection
from raysim.algorithms.scaffold import Scaffold
from raysim.contract import Client, ClientResult
from raysim.config import load_config
from raysim.models import build_model
from raysim.testing import set_up
from raysim.training import cpu_state, effective_steps

PLAIN = ["local.momentum=0", "local.weight_decay=0", "local.lr=0.1"]


def client_of(cfg, model, x, y, state=None, num_classes=2):
    return Client(0, 1, cfg, x, y, num_classes, torch.device("cpu"), torch.Generator().manual_seed(0),
                  state if state is not None else {}, model, epochs=int(cfg.local.epochs))


def grad_at(weights: dict, x, y) -> dict:
    """The full-batch cross-entropy gradient of a Linear(2, 2) with these weights."""
    m = torch.nn.Linear(2, 2)
    m.load_state_dict(weights)
    F.cross_entropy(m(x), y).backward()
    return {"weight": m.weight.grad.clone(), "bias": m.bias.grad.clone()}


def data():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]])
    return x, torch.tensor([0, 1, 1, 0])


# --------------------------------------------------------------------------- SCAFFOLD
def scaffold_case():
    """Data, a Linear(2, 2), its weights x, and given server / client variates c, c_i."""
    x_data, y_data = data()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    c = {"weight": torch.tensor([[0.1, -0.2], [0.0, 0.3]]), "bias": torch.tensor([0.05, -0.05])}
    c_i = {"weight": torch.tensor([[-0.1, 0.1], [0.2, 0.0]]), "bias": torch.tensor([0.0, 0.1])}
    return x_data, y_data, model, cpu_state(model), c, c_i


def test_scaffold_corrected_steps_and_control_variate_option_ii():
    """Two full-batch steps from x with c and c_i given: y1 = x - lr (g(x) - c_i + c),
    y2 = y1 - lr (g(y1) - c_i + c); c_i+ = c_i - c + (x - y2) / (2 lr) = (g(x) + g(y1)) / 2."""
    cfg = load_config(overrides=[*PLAIN, "algorithm=scaffold", "local.steps=2", "local.batch_size=4"])
    x_data, y_data, model, x, c, c_i = scaffold_case()
    lr = 0.1
    g0 = grad_at(x, x_data, y_data)
    y1 = {k: x[k] - lr * (g0[k] - c_i[k] + c[k]) for k in x}
    g1 = grad_at(y1, x_data, y_data)
    y2 = {k: y1[k] - lr * (g1[k] - c_i[k] + c[k]) for k in x}

    client = client_of(cfg, model, x_data, y_data, state={"c": c_i})
    res = Scaffold(cfg, 2, (2,)).client_update(client, {"weights": x, "c": c})
    for k in x:
        assert torch.allclose(res.update["dy"][k], y2[k] - x[k], atol=1e-6), k
        c_new = c_i[k] - c[k] + (x[k] - y2[k]) / (2 * lr)
        assert torch.allclose(client.state["c"][k], c_new, atol=1e-5), k
        assert torch.allclose(client.state["c"][k], (g0[k] + g1[k]) / 2, atol=1e-5), k  # the same, simplified
        assert torch.allclose(res.update["dc"][k], c_new - c_i[k], atol=1e-5), k


def test_scaffold_niid_bench_correction_on_the_weights():
    """NIID-Bench's code: the optimizer steps on the plain gradient (momentum rho), then
    w -= lr (c - c_i); c_i+ = c_i - c + (x - y) / (K lr) with the raw step count K."""
    cfg = load_config(overrides=["local.momentum=0.5", "local.weight_decay=0", "local.lr=0.1", "algorithm=scaffold",
                                 "scaffold.correction=weights", "local.steps=2", "local.batch_size=4"])
    x_data, y_data, model, x, c, c_i = scaffold_case()
    lr, rho = 0.1, 0.5
    g0 = grad_at(x, x_data, y_data)
    y1 = {k: x[k] - lr * g0[k] - lr * (c[k] - c_i[k]) for k in x}
    g1 = grad_at(y1, x_data, y_data)
    y2 = {k: y1[k] - lr * (rho * g0[k] + g1[k]) - lr * (c[k] - c_i[k]) for k in x}
    client = client_of(cfg, model, x_data, y_data, state={"c": c_i})
    res = Scaffold(cfg, 2, (2,)).client_update(client, {"weights": x, "c": c})
    for k in x:
        assert torch.allclose(res.update["dy"][k], y2[k] - x[k], atol=1e-6), k
        assert torch.allclose(client.state["c"][k], c_i[k] - c[k] + (x[k] - y2[k]) / (2 * lr), atol=1e-5), k


def test_scaffold_counts_momentum_steps_as_effective_steps():
    # with momentum rho the variate divides by FedNova's effective step count, = K at rho = 0
    assert effective_steps(3, 0.0) == 3.0
    assert math.isclose(effective_steps(3, 0.5), 3 + 2 * 0.5 + 0.5 ** 2)  # g, g(1+rho), g(1+rho+rho^2)
    assert math.isclose(effective_steps(1, 0.9), 1.0)


def fixed():
    """A 1 -> 1 linear model with weight 1 and bias 0."""
    m = torch.nn.Linear(1, 1)
    with torch.no_grad():
        m.weight.fill_(1.0)
        m.bias.fill_(0.0)
    return m


def scaffold_results():
    t = torch.tensor
    return [ClientResult(0, 10, {"dy": {"weight": t([[2.0]]), "bias": t([1.0])},
                                "dc": {"weight": t([[4.0]]), "bias": t([0.0])}, "buffers": {}}, {"loss": 1.0}),
           ClientResult(2, 30, {"dy": {"weight": t([[-2.0]]), "bias": t([5.0])},
                                "dc": {"weight": t([[8.0]]), "bias": t([-4.0])}, "buffers": {}}, {"loss": 1.0})]


def test_scaffold_server_averages_dy_by_samples_and_adds_sum_dc_over_n():
    cfg = load_config(overrides=["algorithm=scaffold", "scaffold.weighting=samples", "num_clients=4"])
    algo = set_up(cfg, fixed, (1,), 1)
    algo.c = {"weight": torch.tensor([[1.0]]), "bias": torch.tensor([0.0])}
    t = torch.tensor
    algo.aggregate(1, iter(scaffold_results()))
    assert torch.allclose(algo.model.weight, t([[1.0 + (10 * 2 - 30 * 2) / 40]]))  # x + weighted mean dy = 0
    assert torch.allclose(algo.model.bias, t([(10 * 1 + 30 * 5) / 40]))
    assert torch.allclose(algo.c["weight"], t([[1.0 + (4 + 8) / 4]]))  # N = 4 clients in all, 2 returned
    assert torch.allclose(algo.c["bias"], t([-4 / 4]))


def test_scaffold_server_default_is_the_papers_uniform_mean():
    """Paper: x += server_lr * (1/|S|) sum dy_i, whatever the clients' sizes; c as before."""
    cfg = load_config(overrides=["algorithm=scaffold", "scaffold.server_lr=0.5", "num_clients=4"])
    assert cfg.scaffold.weighting == "uniform"
    algo = set_up(cfg, fixed, (1,), 1)
    algo.c = {"weight": torch.tensor([[1.0]]), "bias": torch.tensor([0.0])}
    t = torch.tensor
    algo.aggregate(1, iter(scaffold_results()))
    assert torch.allclose(algo.model.weight, t([[1.0 + 0.5 * (2 - 2) / 2]]))
    assert torch.allclose(algo.model.bias, t([0.5 * (1 + 5) / 2]))
    assert torch.allclose(algo.c["weight"], t([[1.0 + (4 + 8) / 4]]))


# --------------------------------------------------------------------------- FedNova
def test_fednova_aggregate_with_unequal_local_steps():
    """x - tau_eff * sum p_i d_i, tau_eff = sum p_i a_i."""
    algo = set_up(load_config(overrides=["algorithm=fednova"]), fixed, (1,), 1)
    t = torch.tensor
    # client 0: 10 samples, 2 steps, d = [1]; client 1: 30 samples, 6 steps, d = [-1]
    res = [ClientResult(0, 10, {"d": {"weight": t([[1.0]]), "bias": t([2.0])}, "buffers": {}, "a": 2.0}, {"loss": 0.0}),
           ClientResult(1, 30, {"d": {"weight": t([[-1.0]]), "bias": t([0.0])}, "buffers": {}, "a": 6.0}, {"loss": 0.0})]
    out = algo.aggregate(1, iter(res))
    tau_eff = (10 * 2 + 30 * 6) / 40  # 5
    assert out["tau_eff"] == tau_eff
    assert torch.allclose(algo.model.weight, t([[1.0 - tau_eff * (10 * 1 - 30 * 1) / 40]]))  # 1 + 2.5
    assert torch.allclose(algo.model.bias, t([0.0 - tau_eff * (10 * 2) / 40]))  # -2.5


def test_fednova_client_normalises_by_its_steps_and_equals_fedavg_when_steps_are_equal():
    x_data, y_data = data()
    for momentum in (0.0, 0.9):
        cfg = load_config(overrides=[f"local.momentum={momentum}", "local.weight_decay=0", "local.lr=0.1",
                                     "local.batch_size=2", "local.epochs=2", "algorithm=fednova"])
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2)
        x = cpu_state(model)
        nova = FedNova(cfg, 2, (2,)).client_update(client_of(cfg, model, x_data, y_data), {"weights": x})
        a = effective_steps(4, momentum)  # 2 epochs of 2 batches
        assert nova.update["a"] == a
        avg = FedAvg(cfg, 2, (2,)).client_update(client_of(cfg, model, x_data, y_data), {"weights": x})
        for k in x:  # the same training: d = (x - y) / a
            assert torch.allclose(nova.update["d"][k], (x[k] - avg.update[k]) / a, atol=1e-6)
    # two clients with the same a: FedNova's aggregate is FedAvg's
    t = torch.tensor
    ys = [(10, t([[3.0]]), t([1.0])), (30, t([[-1.0]]), t([2.0]))]
    nova, avg = set_up(cfg, fixed, (1,), 1), set_up(load_config(overrides=["algorithm=fedavg"]), fixed, (1,), 1)
    a = 3.0
    nova.aggregate(1, iter([ClientResult(i, n, {"d": {"weight": (1.0 - w) / a, "bias": (0.0 - b) / a}, "buffers": {}, "a": a},
                                         {"loss": 0.0}) for i, (n, w, b) in enumerate(ys)]))
    avg.aggregate(1, iter([ClientResult(i, n, {"weight": w, "bias": b}, {"loss": 0.0}) for i, (n, w, b) in enumerate(ys)]))
    assert torch.allclose(nova.model.weight, avg.model.weight) and torch.allclose(nova.model.bias, avg.model.bias)


# --------------------------------------------------------------------------- MOON
def test_moon_contrastive_loss_on_given_representations():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[2.0, 0.0], [1.0, 0.0]])  # cos: 1, 1/sqrt(2)
    z_prev = torch.tensor([[0.0, 3.0], [-1.0, -1.0]])  # cos: 0, -1
    T = 0.5
    row0 = -math.log(math.exp(1 / T) / (math.exp(1 / T) + math.exp(0 / T)))
    row1 = -math.log(math.exp(2 ** -0.5 / T) / (math.exp(2 ** -0.5 / T) + math.exp(-1 / T)))
    assert math.isclose(float(contrastive_loss(z, z_glob, z_prev, T)), (row0 + row1) / 2, rel_tol=1e-6)


def test_moon_network_and_first_and_later_rounds():
    cfg = load_config(overrides=["algorithm=moon", "moon.out_dim=8", "local.epochs=2", "local.batch_size=16"])
    base = build_model("mlp", (1, 8, 8), 10)
    net = with_projection(base, 8, 10)
    x = torch.randn(5, 1, 8, 8)
    assert net.encoder(x).shape == (5, 8) and torch.equal(net(x), net.head(net.encoder(x)))

    g = torch.Generator().manual_seed(0)
    x_data, y_data = torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g)
    moon = Moon(cfg, 10, (1, 8, 8))
    torch.manual_seed(0)
    start = cpu_state(moon.build_model((1, 8, 8)))
    # first round: no previous model, no contrastive term: FedAvg's step (the projection head, which FedAvg lacks,
    # only decays: the reference's zero gradient reaches it)
    c1 = client_of(cfg, moon.build_model((1, 8, 8)), x_data, y_data, num_classes=10)
    r1 = moon.client_update(c1, {"weights": start})
    plain = moon.build_model((1, 8, 8))
    c_plain = client_of(cfg, plain, x_data, y_data, num_classes=10)
    r_plain = FedAvg(cfg, 10, (1, 8, 8)).client_update(c_plain, {"weights": start})
    assert all(torch.allclose(r1.update[k], r_plain.update[k], atol=1e-6) for k in start)
    assert all(torch.equal(c1.state["prev"][k], r1.update[k]) for k in start)  # the client keeps its model
    # a later round: the previous model differs from the global one, the contrastive term acts
    c2 = client_of(cfg, moon.build_model((1, 8, 8)), x_data, y_data, state=c1.state, num_classes=10)
    c2.round = 2
    r2 = moon.client_update(c2, {"weights": start})
    c_plain2 = client_of(cfg, plain, x_data, y_data, num_classes=10)
    c_plain2.round = 2
    r_plain2 = FedAvg(cfg, 10, (1, 8, 8)).client_update(c_plain2, {"weights": start})
    assert not all(torch.allclose(r2.update[k], r_plain2.update[k], atol=1e-6) for k in start)


def test_moon_at_mu_0_is_fedavg_on_the_same_model(ray_local, tmp_path):
    """The classifier reads the configured model's encoder (the default), so MOON without its
    contrastive term is FedAvg bit for bit; with it, the models differ."""
    from raysim.run import main

    common = ["dataset=digits", "model=mlp", "num_clients=6", "participation=0.5", "rounds=3",
              "partition=classes", "partition.k=2", f"output_dir={tmp_path}", "--quiet"]
    for name, extra in (("fedavg", ["algorithm=fedavg"]), ("mu0", ["algorithm=moon", "moon.mu=0"]),
                        ("mu1", ["algorithm=moon", "moon.mu=1"])):
        assert main([*common, *extra, f"run_name={name}"]) == 0
    fedavg, mu0, mu1 = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"]
                        for n in ("fedavg", "mu0", "mu1"))
    assert set(mu0) - set(fedavg) and all(k.startswith("projection.") for k in set(mu0) - set(fedavg))
    assert all(torch.equal(fedavg[k], mu0[k]) for k in fedavg)
    assert not all(torch.equal(fedavg[k], mu1[k]) for k in fedavg)


def test_moon_first_participation_after_round_1():
    """Authors' code: a client first selected in a later round has its own initial network as
    'previous' (contrastive term active); `first_previous=global`: the global model (FedAvg's step)."""
    g = torch.Generator().manual_seed(0)
    x_data, y_data = torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g)
    updates = {}
    for first in ("initial", "global"):
        cfg = load_config(overrides=["algorithm=moon", "moon.out_dim=8", "local.batch_size=16",
                                     f"moon.first_previous={first}"])
        moon = Moon(cfg, 10, (1, 8, 8))
        torch.manual_seed(0)
        start = cpu_state(moon.build_model((1, 8, 8)))
        c = client_of(cfg, moon.build_model((1, 8, 8)), x_data, y_data, num_classes=10)
        c.round = 3
        updates[first] = moon.client_update(c, {"weights": start}).update
        init_a, init_b = moon.initial_network(c), moon.initial_network(c)
        assert all(torch.equal(init_a[k], init_b[k]) for k in init_a)  # from (seed, client id)
        c.cid = 1
        assert not torch.equal(moon.initial_network(c)["head.weight"], init_a["head.weight"])
    plain = moon.build_model((1, 8, 8))
    c_plain = client_of(cfg, plain, x_data, y_data, num_classes=10)
    c_plain.round = 3
    fedavg = FedAvg(cfg, 10, (1, 8, 8)).client_update(c_plain, {"weights": start}).update
    assert all(torch.allclose(updates["global"][k], fedavg[k], atol=1e-6) for k in start)
    assert not all(torch.allclose(updates["initial"][k], fedavg[k], atol=1e-6) for k in start)


# --------------------------------------------------------------------------- FedRS, FedLC
def test_fedrs_logit_scales_soft_and_binary():
    counts = np.array([40, 0, 10, 1])
    # authors' code: alpha + (1 - alpha) n_c / n_max: rare present classes are damped too
    assert torch.allclose(logit_scale(counts, 0.5, "soft"), torch.tensor([1.0, 0.5, 0.625, 0.5 + 0.5 / 40]))
    # the paper's text: absent classes x alpha, present ones untouched
    assert torch.equal(logit_scale(counts, 0.5, "binary"), torch.tensor([1.0, 0.5, 1.0, 1.0]))
    assert torch.equal(logit_scale(counts, 1.0, "soft"), torch.ones(4))  # alpha = 1: FedAvg


def test_fedrs_local_logits_are_scaled_and_have_no_bias_by_default():
    cfg = load_config(overrides=["algorithm=fedrs", "fedrs.alpha=0.2"])
    model = build_model("mclr", (2,), 3)
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        model.head.bias.fill_(5.0)
    x, y = torch.tensor([[2.0, 3.0]]), torch.tensor([0])
    client = client_of(cfg, model, torch.zeros(5, 2), torch.tensor([0, 0, 0, 0, 2]), num_classes=3)
    loss = FedRS(cfg, 3, (2,)).local_loss(client, {})(model, x, y)
    s = [1.0, 0.2, 0.2 + 0.8 / 4]  # counts 4, 0, 1
    logits = torch.tensor([[2.0 * s[0], 3.0 * s[1], 5.0 * s[2]]])  # h W^T, no bias
    assert torch.isclose(loss, F.cross_entropy(logits, y))
    with_bias = load_config(overrides=["algorithm=fedrs", "fedrs.alpha=0.2", "fedrs.bias=true", "fedrs.scaling=binary"])
    loss_b = FedRS(with_bias, 3, (2,)).local_loss(client, {})(model, x, y)
    assert torch.isclose(loss_b, F.cross_entropy(torch.tensor([[7.0, 8.0 * 0.2, 10.0]]), y))
    algo = set_up(cfg, lambda: build_model("mclr", (2,), 3), (2,), 3)
    assert torch.equal(algo.model.head.bias, torch.zeros(3))  # the authors' classifier has no bias


def test_fedlc_calibrates_logits_by_class_counts():
    logits = torch.zeros(2, 3)
    counts = torch.tensor([16.0, 1.0, 0.0])
    out = calibrated_logits(logits, counts, tau=2.0)
    expected = torch.tensor([-2 * 16 ** -0.25, -2.0, -2 * 1e-8 ** -0.25])  # -1, -2, -200
    assert torch.allclose(out, expected.expand(2, 3))
    assert torch.equal(calibrated_logits(logits + 1, counts, tau=0.0), logits + 1)
    # fedlc.absent_count=1: an absent class is shifted as a class seen once (-2), not out of the softmax
    assert torch.allclose(calibrated_logits(logits, counts, tau=2.0, absent=1.0),
                          torch.tensor([-1.0, -2.0, -2.0]).expand(2, 3))


def test_fedrs_and_fedlc_train_with_their_losses():
    """The client half really uses the restricted / calibrated softmax: a client holding only
    classes {0, 1} of 3 moves the absent class's row less than FedAvg would."""
    g = torch.Generator().manual_seed(0)
    x_data = torch.randn(30, 4, generator=g)
    y_data = torch.randint(0, 2, (30,), generator=g)
    cfg = load_config(overrides=["local.epochs=3", "local.batch_size=10"])
    cfg.fedrs.alpha, cfg.fedlc.tau = 0.1, 1.0  # one config for three algorithms' client halves
    from raysim.algorithms.fedlc import FedLC

    def moved(algo_cls):
        torch.manual_seed(0)
        model = build_model("mclr", (4,), 3)
        start = cpu_state(model)
        res = algo_cls(cfg, 3, (4,)).client_update(client_of(cfg, model, x_data, y_data, num_classes=3),
                                                   {"weights": start})
        return float((res.update["head.weight"][2] - start["head.weight"][2]).norm())

    assert moved(FedRS) < 0.5 * moved(FedAvg)
    assert moved(FedLC) < 0.5 * moved(FedAvg)
    assert np.isfinite(moved(FedLC))


def test_fedlc_takes_absent_classes_out_of_the_softmax():
    """The measured cause of FedLC's gap under #C=2 (benchmarks/README.md): an absent class
    (n_c = 0, read as 1e-8) is shifted by -100 tau, so the client's loss has no gradient on
    its classifier row, where FedAvg pushes it down; at tau = 0.01 (shift -1) it is back."""
    from raysim.algorithms.fedlc import FedLC

    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1] * 4)

    def absent_row_grad(algo_cls, *over):
        cfg = load_config(overrides=["algorithm=fedlc", *over])
        torch.manual_seed(0)
        model = build_model("mclr", (4,), 3)
        client = client_of(cfg, model, x, y, num_classes=3)
        algo_cls(cfg, 3, (4,)).local_loss(client, {})(model, x, y).backward()
        return float(model.head.weight.grad[2].norm())

    plain = absent_row_grad(FedAvg)
    assert absent_row_grad(FedLC) < 1e-12 * plain
    assert absent_row_grad(FedLC, "fedlc.tau=0.01") > 0.1 * plain
