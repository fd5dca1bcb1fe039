"""Clustered FL (issue 12): FedGroup / FedGrouProx, IFCA, FeSEM against their definitions
(ALGORITHMS.md), then real runs: newcomers placed, checkpoint + resume."""
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from raysim.contract import Client, ClientResult
from raysim.algorithms.clustered import flat
from raysim.algorithms.fedgroup import FedGroup, cosine_dissimilarity, edc_labels, madc, madc_labels
from raysim.algorithms.fesem import FeSEM
from raysim.algorithms.ifca import IFCA
from raysim.config import load_config
from raysim.models import build_model
from raysim.run import main
from raysim.training import cpu_state, local_sgd, seed_for

SHAPE = (1, 8, 8)


def updates_from_directions(n_per_group=(20, 25, 15), dim=300, noise=0.3, seed=0):
    """Client updates = a random scale x one of a few known directions + Gaussian noise."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(len(n_per_group), dim))
    truth = np.repeat(np.arange(len(n_per_group)), n_per_group)
    scale = rng.uniform(0.5, 2.0, len(truth))[:, None]
    return scale * directions[truth] + noise * rng.normal(size=(len(truth), dim)), truth


@pytest.mark.parametrize("measure", ["edc", "madc"])
def test_edc_and_madc_recover_groups_of_known_directions(measure):
    dw, truth = updates_from_directions()
    perm = np.random.default_rng(1).permutation(len(truth))  # the order of clients does not matter
    dw, truth = dw[perm], truth[perm]
    labels = edc_labels(dw, 3, seed=0) if measure == "edc" else madc_labels(dw, 3)
    assert adjusted_rand_score(truth, labels) == 1.0


def test_madc_is_the_mean_absolute_difference_of_cosines_over_the_other_clients():
    dw = np.random.default_rng(2).normal(size=(5, 7))
    s = dw @ dw.T / np.outer(np.linalg.norm(dw, axis=1), np.linalg.norm(dw, axis=1))
    by_hand = np.zeros((5, 5))
    for i in range(5):
        for j in range(5):
            if i != j:
                by_hand[i, j] = np.mean([abs(s[i, z] - s[j, z]) for z in range(5) if z not in (i, j)])
    assert np.allclose(madc(dw), by_hand)


class Stub:
    """Stands in for the runtime: a client's "training" returns w0 + the update given here."""

    num_clients = 6
    num_classes = 10
    input_shape = SHAPE

    def __init__(self, cfg, updates):
        self.cfg, self.updates, self.calls = cfg, updates, []

    def new_model(self):
        torch.manual_seed(0)
        return build_model("mlp", SHAPE, 10, {"hidden": [4]})

    def rng(self, rnd, stream=0):
        return np.random.default_rng([0, rnd, stream])

    def available_clients(self, rnd):
        return list(range(self.num_clients))

    def run_clients(self, rnd, cids, payload, method="client_update"):
        self.calls.append((rnd, list(cids)))
        for c in cids:
            w = {k: v.clone() for k, v in payload["weights"].items()}
            for k, d in self.updates[c].items():
                w[k] += d
            yield ClientResult(c, 10 + c, w, {"loss": 1.0})


def fedgroup(*overrides, updates=None):
    cfg = load_config(overrides=["algorithm=fedgroup", "model=mlp", "model_options.hidden=[4]", "num_clients=6",
                                 "fedgroup.groups=2", "fedgroup.alpha=2", *overrides])
    algo = FedGroup(cfg, 10, SHAPE)
    server = Stub(cfg, updates or {})
    algo.setup(server)
    return algo, server


def along(algo, key, sign, scale=1.0):
    """An update that moves only `key` of the model, by +-scale in every entry."""
    return {key: sign * scale * torch.ones_like(algo.w0.state_dict()[key])}


def test_group_cold_start_averages_members_and_a_cold_client_joins_the_closest_direction():
    algo, _ = fedgroup()
    a, b = "encoder.1.weight", "head.weight"  # two orthogonal directions in parameter space
    updates = {0: along(algo, a, 1), 1: along(algo, a, 1, 3.0), 2: along(algo, b, 1), 3: along(algo, b, 1, 2.0),
               4: along(algo, b, 1, 0.5), 5: along(algo, a, 1, 0.1)}
    algo, server = fedgroup(updates=updates)
    algo.group_cold_start(1, server)  # 2 x 2 = 4 pre-training clients of the 6
    pre = server.calls[0][1]
    assert server.calls[0][0] == 0 and len(pre) == 4
    ga = {int(algo.group_of[c]) for c in pre if c in (0, 1, 5)}
    gb = {int(algo.group_of[c]) for c in pre if c in (2, 3, 4)}
    assert len(ga) == 1 and len(gb) == 1 and ga != gb  # the two directions are two groups
    g = ga.pop()
    members = [c for c in pre if algo.group_of[c] == g]
    w0 = algo.w0.state_dict()[a]
    expected = w0 + sum(updates[c][a] for c in members) / len(members)  # w0 + unweighted mean update
    assert torch.allclose(algo.models[g].state_dict()[a], expected)
    cold = [c for c in range(6) if algo.group_of[c] < 0]
    algo.client_cold_start(2, cold, server)  # each trains from w0 and joins its direction's group
    for c in cold:
        assert algo.group_of[c] == (g if c in (0, 1, 5) else 1 - g)


def test_cosine_dissimilarity_is_zero_for_the_same_direction_and_one_for_the_opposite():
    d = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    assert np.allclose(cosine_dissimilarity(d, torch.tensor([3.0, 0.0], dtype=torch.float64)), [0, 0.5, 1, 0.5])


def test_a_group_without_a_member_in_the_cohort_keeps_its_model():
    algo, _ = fedgroup()
    updates = {c: along(algo, "head.bias", 1, 0.1 * (c + 1)) for c in range(6)}
    algo, server = fedgroup(updates=updates)
    algo.group_of[:] = [0, 0, 0, 1, 1, 1]
    for g, m in enumerate(algo.models):
        m.load_state_dict({k: v + g for k, v in algo.w0.state_dict().items()})
    before = [cpu_state(m) for m in algo.models]
    metrics = algo.train_groups(3, server, [0, 2])  # only group 0's members
    assert all(torch.equal(v, before[1][k]) for k, v in algo.models[1].state_dict().items())
    n = {0: 10, 2: 12}  # sample-weighted FedAvg inside the group
    expected = before[0]["head.bias"] + sum(n[c] * 0.1 * (c + 1) for c in n) / sum(n.values())
    assert torch.allclose(algo.models[0].state_dict()["head.bias"], expected)
    assert metrics["groups_trained"] == 1 and metrics["group_sizes"] == [3, 3]
    aux = (algo.models[0].state_dict()["head.bias"] + algo.models[1].state_dict()["head.bias"]) / 2
    assert torch.allclose(algo.aux.state_dict()["head.bias"], aux)  # the auxiliary model: plain mean


def test_inter_group_aggregation_adds_the_other_groups_unit_models_to_parameters_only():
    algo, _ = fedgroup("fedgroup.eta_g=0.5")
    for g, m in enumerate(algo.models):
        m.load_state_dict({k: torch.full_like(v, float(g + 1)) if v.is_floating_point() else v
                           for k, v in algo.w0.state_dict().items()})
    tilde = [flat(m.state_dict(), algo.names) for m in algo.models]
    algo.mix_groups([0, 1])
    expected = tilde[0] + 0.5 * tilde[1] / torch.linalg.vector_norm(tilde[1])
    assert torch.allclose(flat(algo.models[0].state_dict(), algo.names), expected)


def a_client(x, y, cfg, state=None):
    model = build_model("mlp", SHAPE, 10, {"hidden": [4]})
    return Client(cid=0, round=1, cfg=cfg, x=x, y=y, num_classes=10, device=torch.device("cpu"),
                  generator=torch.Generator().manual_seed(0), state=state if state is not None else {}, model=model)


@pytest.mark.parametrize("steps", [50, 0])
def test_a_fedgroup_pretraining_runs_the_authors_50_steps_and_a_round_its_epochs(steps):
    """Both authors' codes pre-train with `solve_iters(50)`: 50 minibatch steps from w0 (FlexCFL
    client.pretrain, GrouProx pre_train_client), not the round's E epochs; pretrain_steps=0
    is the round's local training. The model after it is local_sgd's with that many steps."""
    cfg = load_config(overrides=["algorithm=fedgroup", "model=mlp", "model_options.hidden=[4]", "local.epochs=3",
                                 "local.batch_size=10", f"fedgroup.pretrain_steps={steps}"])
    algo = FedGroup(cfg, 10, SHAPE)
    algo.setup(Stub(cfg, {}))
    x, y = torch.randn(45, *SHAPE), torch.randint(0, 10, (45,))  # 5 batches an epoch

    def a_client_of_3_epochs():
        client = a_client(x, y, cfg)
        client.epochs = 3  # the runtime sets it from local.epochs
        return client

    got = algo.client_update(a_client_of_3_epochs(), algo.pretraining())
    assert got.metrics["steps"] == (steps or 3 * 5)
    by_hand = a_client_of_3_epochs()
    by_hand.model.load_state_dict(algo.w0.state_dict())
    local_sgd(by_hand, by_hand.model, steps=steps or None)
    assert all(torch.equal(v, by_hand.model.state_dict()[k]) for k, v in got.update.items())
    trained = algo.client_update(a_client_of_3_epochs(), {"weights": cpu_state(algo.w0)})  # a group round: epochs
    assert trained.metrics["steps"] == 15


def test_an_ifca_client_picks_the_model_with_the_lowest_loss_on_its_training_data():
    cfg = load_config(overrides=["algorithm=ifca", "model=mlp", "model_options.hidden=[4]", "ifca.groups=3"])
    x, y = torch.randn(40, *SHAPE), torch.randint(0, 10, (40,))
    models = []
    for g in range(3):
        torch.manual_seed(seed_for(0, 888, g))
        models.append(cpu_state(build_model("mlp", SHAPE, 10, {"hidden": [4]})))
    fit = a_client(x, y, cfg)
    fit.model.load_state_dict(models[1])
    opt = torch.optim.SGD(fit.model.parameters(), lr=0.5)
    for _ in range(50):  # model 1, fitted to this client's data: the lowest loss of the three
        opt.zero_grad()
        torch.nn.functional.cross_entropy(fit.model(x), y).backward()
        opt.step()
    models[1] = cpu_state(fit.model)
    losses = []
    with torch.no_grad():
        for w in models:
            fit.model.load_state_dict(w)
            losses.append(float(torch.nn.functional.cross_entropy(fit.model(x), y)))
    assert int(np.argmin(losses)) == 1
    result = IFCA(cfg, 10, SHAPE).client_update(a_client(x, y, cfg), {"models": models})
    assert result.metrics["group"] == 1


def test_a_fesem_client_joins_the_centre_nearest_its_own_local_model():
    cfg = load_config(overrides=["algorithm=fesem", "model=mlp", "model_options.hidden=[4]", "fesem.groups=3"])
    base = cpu_state(build_model("mlp", SHAPE, 10, {"hidden": [4]}))
    centres = [{k: v + shift for k, v in base.items()} for shift in (0.0, 1.0, 2.0)]
    mine = {k: v + 1.9 for k, v in base.items()}
    client = a_client(torch.randn(20, *SHAPE), torch.randint(0, 10, (20,)), cfg, state={"model": mine})
    result = FeSEM(cfg, 10, SHAPE).client_update(client, {"models": centres})
    assert result.metrics["group"] == 2
    assert client.state["model"] is result.update  # its new local model, for next time
    fresh = a_client(torch.randn(20, *SHAPE), torch.randint(0, 10, (20,)), cfg)  # never trained: w0
    assert FeSEM(cfg, 10, SHAPE).client_update(fresh, {"models": centres, "init": base}).metrics["group"] == 0


COMMON = ["dataset=digits", "model=mlp", "num_clients=12", "participation=0.5", "local.epochs=1",
          "partition.test_fraction=0.2", "fedgroup.groups=2", "fedgroup.alpha=2"]


def test_fedgroup_places_a_newcomer_when_first_selected_and_trains_it_in_its_group(ray_local, tmp_path):
    assert main(["algorithm=fedgroup", *COMMON, "rounds=6", "clients.join.fraction=0.25", "clients.join.round=3",
                 f"output_dir={tmp_path}", "run_name=late", "--quiet"]) == 0
    rows = pq.read_table(tmp_path / "late" / "clients.parquet").to_pylist()
    joined = {r["cid"]: r["round"] for r in rows if r["method"] == "join"}
    assert len(joined) == 3
    trained = {}
    for r in rows:
        if r["cid"] in joined and r["method"] == "client_update":
            assert r["round"] >= joined[r["cid"]], r  # never before it is there
            trained.setdefault(r["cid"], []).append(r["round"])
    assert trained, "no newcomer was selected"
    for cid, rounds in trained.items():  # first selection: pre-training from w0, then training in its group
        assert rounds.count(min(rounds)) == 2, (cid, rounds)
    m = pq.read_table(tmp_path / "late" / "metrics.parquet").to_pylist()
    assert m[0]["pretrained"] == 4 and all(sum(r["group_sizes"]) == r["placed"] for r in m)
    assert m[-1]["placed"] >= 4 + len(trained)
    state = torch.load(tmp_path / "late" / "model.pt", weights_only=True)
    assert all(state["group_of"][c] >= 0 for c in trained)
    assert all(r.get("local_accuracy") is not None for r in m)


@pytest.mark.parametrize("algorithm", ["fedgrouprox", "fesem"])
def test_clustered_fl_resumes_mid_run_to_the_same_models(ray_local, tmp_path, algorithm):
    common = [f"algorithm={algorithm}", *COMMON, "checkpoint_every=2", f"output_dir={tmp_path}", "--quiet"]
    if algorithm == "fesem":
        common = [o for o in common if not o.startswith("fedgroup.")] + ["fesem.groups=2"]
    assert main([*common, "rounds=2", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "--quiet"]) == 0
    assert main([*common, "rounds=4", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("part", "whole"))
    assert torch.equal(a["group_of"], b["group_of"])
    for ga, gb in zip(a["groups"], b["groups"]):
        assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_fedgroup_gives_the_same_groups_and_models_with_1_and_3_actors(ray_local, tmp_path):
    common = ["algorithm=fedgroup", *COMMON, "rounds=3", f"output_dir={tmp_path}", "--quiet"]
    for n in (1, 3):
        assert main([*common, f"resources.num_actors={n}", f"run_name=a{n}"]) == 0
    a, b = (torch.load(tmp_path / f"a{n}" / "model.pt", weights_only=True) for n in (1, 3))
    assert torch.equal(a["group_of"], b["group_of"]) and torch.equal(a["directions"], b["directions"])
    for ga, gb in zip(a["groups"], b["groups"]):
        assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_direction_latest_makes_a_trained_groups_direction_its_last_update():
    algo, _ = fedgroup()
    updates = {c: along(algo, "head.bias", 1, 0.1) for c in range(6)}
    for how in ("initial", "latest"):
        algo, server = fedgroup(f"fedgroup.direction={how}", updates=updates)
        algo.group_of[:] = [0, 0, 0, 1, 1, 1]
        before = flat(algo.models[0].state_dict(), algo.names)
        algo.train_groups(2, server, [0, 1])
        moved = flat(algo.models[0].state_dict(), algo.names) - before
        assert torch.allclose(algo.directions[0], moved) == (how == "latest")
        assert not algo.directions[1].any()  # an untrained group keeps its direction
