"""Server parts (raysim/aggregation): optimisers and aggregators against hand computations,
the parameters-vs-buffers rule under every combination, which algorithms take them, and
runs end to end."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from raysim.aggregation import ServerRule
from raysim.config import ConfigError, load_config
from raysim.registry import AGGREGATORS, SERVER_OPTIMIZERS
from raysim.run import main
from raysim.testing import InProcessServer


def server(**kw):
    return OmegaConf.merge(load_config().server, kw)


# ---------------------------------------------------------------- optimisers, 3 rounds by hand
X0, AGG = [1.0, -2.0], [[2.0, -2.5], [1.5, -1.0], [0.0, 0.5]]  # the aggregate a_t of rounds 1-3


def by_hand(kind: str, lr=0.1, b1=0.9, b2=0.99, tau=1e-3, flower=False):
    """Reddi et al. 2021, Algorithm 2, in plain Python floats, one coordinate at a time;
    `flower`: Flower's FedOpt (v from 0; FedAdam's step times √(1-β2^(t+1)) / (1-β1^(t+1)))."""
    out = []
    for i, x in enumerate(X0):
        m, v = 0.0, (0.0 if flower else tau ** 2)
        for t, a in enumerate(AGG, start=1):
            d = a[i] - x
            m = b1 * m + (1 - b1) * d
            if kind == "adam":
                v = b2 * v + (1 - b2) * d * d
            elif kind == "yogi":
                v = v - (1 - b2) * d * d * math.copysign(1.0, v - d * d) if v != d * d else v
            else:
                v = v + d * d
            eta = lr * math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1)) if flower and kind == "adam" else lr
            x = x + eta * m / (math.sqrt(v) + tau)
        out.append(x)
    return out


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_adaptive_optimisers_follow_reddi_et_al_over_three_rounds(kind):
    opt = SERVER_OPTIMIZERS.get(kind)(server(optimizer=kind, lr=0.1, tau=1e-3))
    x = {"w": torch.tensor(X0, dtype=torch.float64)}
    for a in AGG:
        x = opt.step(x, {"w": torch.tensor(a, dtype=torch.float64)})
    assert torch.allclose(x["w"], torch.tensor(by_hand(kind), dtype=torch.float64), rtol=1e-12, atol=1e-12)
    state = opt.state_dict()
    fresh = SERVER_OPTIMIZERS.get(kind)(server(optimizer=kind, lr=0.1))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.step(x, {"w": x["w"] + 1})["w"], opt.step(x, {"w": x["w"] + 1})["w"])  # state carried


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_server_fedopt_flower_follows_flowers_fedopt_over_three_rounds(kind):
    opt = SERVER_OPTIMIZERS.get(kind)(server(optimizer=kind, lr=0.1, tau=1e-3, fedopt="flower"))
    x = {"w": torch.tensor(X0, dtype=torch.float64)}
    for a in AGG:
        x = opt.step(x, {"w": torch.tensor(a, dtype=torch.float64)})
    want = by_hand(kind, flower=True)
    assert torch.allclose(x["w"], torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert want != by_hand(kind)  # the two conventions do differ on these numbers
    fresh = SERVER_OPTIMIZERS.get(kind)(server(optimizer=kind, lr=0.1, fedopt="flower"))
    fresh.load_state_dict(opt.state_dict())  # the step count resumes too (FedAdam's correction)
    assert torch.equal(fresh.step(x, {"w": x["w"] + 1})["w"], opt.step(x, {"w": x["w"] + 1})["w"])


def test_sgd_and_momentum():
    x, a = {"w": torch.tensor([1.0, 3.0])}, {"w": torch.tensor([2.0, 2.0])}
    plain = SERVER_OPTIMIZERS.get("sgd")(server()).step(x, a)
    assert plain["w"] is a["w"]  # lr 1: the aggregate itself, FedAvg bit for bit
    assert torch.equal(SERVER_OPTIMIZERS.get("sgd")(server(lr=0.5)).step(x, a)["w"], torch.tensor([1.5, 2.5]))
    mom = SERVER_OPTIMIZERS.get("momentum")(server(momentum=0.5, lr=1.0))
    x1 = mom.step(x, a)  # v = x - a = [-1, 1]; x - v = [2, 2]
    x2 = mom.step(x1, {"w": torch.tensor([3.0, 3.0])})  # v = 0.5 [-1, 1] + [-1, -1] = [-1.5, -0.5]
    assert torch.equal(x1["w"], torch.tensor([2.0, 2.0])) and torch.equal(x2["w"], torch.tensor([3.5, 2.5]))


# ---------------------------------------------------------------- aggregators on hand-made models
def fold(aggregator, values, weights=None, **kw):
    rule = ServerRule(server(aggregator=aggregator, **kw), {"w"})
    f = rule.round()
    for i, v in enumerate(values):
        f.add({"w": torch.tensor(v)}, (weights or [1.0] * len(values))[i])
    return f.result({"w": torch.zeros(len(values[0]))})["w"]


def test_median_odd_even_and_ties():
    assert torch.equal(fold("median", [[1.0, 5.0], [3.0, 5.0], [2.0, 9.0]]), torch.tensor([2.0, 5.0]))
    assert torch.equal(fold("median", [[1.0, 5.0], [4.0, 5.0], [2.0, 9.0], [10.0, 1.0]]), torch.tensor([3.0, 5.0]))
    assert torch.equal(fold("median", [[7.0], [7.0], [7.0], [1.0]]), torch.tensor([7.0]))
    # unweighted: sample counts do not move it
    assert torch.equal(fold("median", [[0.0], [1.0], [100.0]], [1000.0, 1.0, 1.0]), torch.tensor([1.0]))


def test_trimmed_mean_cuts_floor_of_the_share_at_each_end():
    values = [[1.0], [2.0], [3.0], [4.0], [100.0]]
    assert torch.allclose(fold("trimmed_mean", values, trim=0.2), torch.tensor([3.0]))  # cut 1 each end
    assert torch.allclose(fold("trimmed_mean", values[:4], trim=0.2), torch.tensor([2.5]))  # floor(0.8) = 0
    assert torch.allclose(fold("trimmed_mean", values, trim=0.4), torch.tensor([3.0]))  # cut 2: the median


def test_krum_picks_the_most_central_and_multi_krum_averages_the_best():
    honest = [[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, 0.5]]
    values = honest + [[50.0, -50.0]]
    # f = 1: scores over the n - f - 2 = 3 nearest; the centre (0.5, 0.5) has the smallest
    assert torch.equal(fold("krum", values, byzantine=1), torch.tensor([0.5, 0.5]))
    # ties go to the lowest client id: the four corners score alike after the centre
    two = fold("multi_krum", values, byzantine=1, krum_m=2)
    assert torch.allclose(two, torch.tensor([0.25, 0.25]))  # the centre and corner 0


def test_geometric_median_resists_an_outlier_and_takes_weights():
    gm = fold("geometric_median", [[0.0], [1.0], [10.0]])
    assert abs(float(gm) - 1.0) < 1e-3
    heavy = fold("geometric_median", [[0.0], [1.0], [10.0]], [1.0, 1.0, 5.0])
    assert abs(float(heavy) - 10.0) < 1e-3  # more than half the weight sits at 10


# ---------------------------------------------------------------- buffers: the weighted mean, always
@pytest.mark.parametrize("aggregator", sorted(AGGREGATORS.names()))
@pytest.mark.parametrize("optimizer", sorted(SERVER_OPTIMIZERS.names()))
def test_buffers_take_the_plain_weighted_mean_under_every_part(aggregator, optimizer):
    rule = ServerRule(server(aggregator=aggregator, optimizer=optimizer, lr=0.5, byzantine=0, krum_m=2), {"w"})
    current = {"w": torch.zeros(3), "running_var": torch.ones(3), "count": torch.tensor(4)}
    f = rule.round()
    states = [({"w": torch.full((3,), float(i)), "running_var": torch.full((3,), float(i + 1)),
                "count": torch.tensor(4 + i)}, float(n)) for i, n in enumerate([10, 30, 60, 100])]
    for s, n in states:
        f.add(s, n)
    new = f.result(current)
    expected = sum(n * (i + 1) for i, (_, n) in enumerate(states)) / 200
    assert torch.allclose(new["running_var"], torch.full((3,), expected))
    assert int(new["count"]) == 7 and new["count"].dtype == torch.int64


# ---------------------------------------------------------------- which algorithms take them
@pytest.mark.parametrize("overrides,message", [
    (["algorithm=scaffold", "server.aggregator=median"],
     "server.aggregator=median: algorithm 'scaffold' does not take a server aggregator (its server step adds"),
    (["algorithm=fednova", "server.optimizer=adam"], "algorithm 'fednova' does not take a server optimizer"),
    (["algorithm=fedavgm", "server.optimizer=adam"],
     "algorithm 'fedavgm' does not take a server optimizer (it is FedAvg with server.optimizer=momentum"),
    (["server.aggregator=krum", "server.byzantine=4", "clients_per_round=10"],
     "needs more than 10 clients per round (Krum's n > 2f + 2); this run has 10"),
    (["server.aggregator=mode"], "server.aggregator='mode' is not a known aggregator; choose one of: geometric_median,"),
    (["server.trim=0.5"], "server.trim must be in [0, 0.5)"),
    (["server.fedopt=pytorch"], "server.fedopt must be reddi or flower, got 'pytorch'"),
])
def test_a_part_an_algorithm_does_not_take_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_fedprox_with_a_server_adam_and_creff_with_a_median_learn_in_process():
    torch.set_num_threads(1)
    common = ["dataset=digits", "num_clients=8", "participation=0.5", "rounds=4"]
    for extra in (["algorithm=fedprox", "server.optimizer=adam", "server.lr=0.03"],
                  ["algorithm=creff", "server.aggregator=median", "creff.match_steps=5", "creff.retrain_epochs=2",
                   "creff.retrain_start=aggregated", "creff.retrain_lr=0.1"]):
        run = InProcessServer.from_config(load_config(overrides=[*common, *extra])).run()
        assert run[-1]["accuracy"] > 0.3, (extra, run[-1])


def test_an_optimisers_state_resumes_bit_for_bit(ray_local, tmp_path):
    common = ["dataset=digits", "model=mlp", "num_clients=8", "participation=0.5", "checkpoint_every=2",
              "server.optimizer=yogi", "server.lr=0.03", "server.aggregator=trimmed_mean", "server.trim=0.25",
              f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=2", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "--quiet"]) == 0
    assert main([*common, "rounds=4", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("part", "whole"))
    assert set(a) == {"global", "m", "v"} == set(b)
    for part in a:
        assert all(torch.equal(a[part][k], b[part][k]) for k in b[part]), part


def test_the_docs_composition_table_is_the_registrys():
    from pathlib import Path

    from raysim import registry

    doc = (Path(__file__).resolve().parent.parent / "docs" / "algorithms.md").read_text()
    rows = doc.split("<!-- composition table -->\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    shown = {r.split("|")[1].strip().strip("`"): [c.strip() for c in r.split("|")[2:7]] for r in rows}
    yn = {True: "yes", False: "no"}
    for name in registry.ALGORITHMS.names():
        a = registry.ALGORITHMS.get(name)
        if not registry.module_of(a).startswith("raysim."):
            continue
        opt = "yes" if "optimizer" in a.server_parts else ("its own momentum" if "aggregator" in a.server_parts else "no")
        modes = [m for m, on in (("central", "privacy" in a.server_parts), ("local", a.trains_privately)) if on]
        privacy = ", ".join(modes) or "no"
        assert shown[name] == [yn["aggregator" in a.server_parts], opt, yn[a.vectorizes()], yn[a.trains_on_base_loss],
                               privacy], name


# ---------------------------------------------------------------- partial sums inside the actors
def test_partial_sums_are_bit_identical_across_actor_counts_and_in_process(ray_local, tmp_path):
    """server.partial_sums=4: each actor sends one weighted sum per block of 4 clients (by
    client id); 1, 2 and 3 actors and the in-process server give the same model, bit for bit,
    and the clients table still has a row per client."""
    from same_bits import same_bits_on_ray_and_in_process

    common = ["dataset=digits", "num_clients=12", "participation=0.75", "rounds=3", "server.partial_sums=4",
              "attack.kind=sign_flip", "attack.fraction=0.2", "algorithm=fedprox"]
    models, rows = same_bits_on_ray_and_in_process(tmp_path, common, (1, 2, 3))
    assert all(len(r) == 3 * 9 and all(x["loss"] is not None for x in r) for r in rows)
    plain = InProcessServer.from_config(load_config(overrides=[o for o in common if "partial" not in o]))
    plain.run()
    for k, v in plain.algorithm.model.state_dict().items():  # the same sum, added in another order
        assert torch.allclose(models[0][k], v, atol=1e-5), k


def test_partial_sums_are_refused_where_each_model_is_needed():
    for overrides, message in [(["server.partial_sums=4", "server.aggregator=median"], "only the mean aggregator"),
                               (["server.partial_sums=4", "algorithm=scaffold"], "does not fold its clients' models"),
                               (["server.partial_sums=4", "local.vectorize=true", "model=mclr"],
                                "set server.partial_sums=local.vectorize_group=64")]:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=overrides)
