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


def test_fedbn_refuses_a_model_without_batchnorm_in_one_line(tmp_path, capsys):
    assert main(["algorithm=fedbn", "dataset=digits", "model=mlp", "rounds=1", f"output_dir={tmp_path}",
                 "run_name=r", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "algorithm=fedbn keeps each client's BatchNorm layers, but model='mlp' has none" in err, err
    assert "resnet8" in err and "Traceback" not in err and not (tmp_path / "r").exists()


# (algorithm, its model, overrides for learning, personal accuracy it reaches on digits)
LEARNS = [("fedbn", ["model=resnet8"], ["partition=dirichlet", "partition.beta=0.5", "rounds=8", "local.lr=0.1"], 0.75)]


@pytest.mark.parametrize("algorithm,model,learn,reaches", LEARNS, ids=[a[0] for a in LEARNS])
def test_learns_on_digits_and_gives_the_same_bits_on_any_actors_and_resumed(ray_local, tmp_path, algorithm, model,
                                                                            learn, reaches):
    """digits, 10 clients with two labels each, half a round: the same model and personal
    accuracy on 1 and 3 actors, in process, and stopped after round 2 then resumed; then
    each client's own model learns (a Dirichlet split, a few rounds more)."""
    from same_bits import same_bits_on_ray_and_in_process
    import pyarrow.parquet as pq

    common = [f"algorithm={algorithm}", "dataset=digits", *model, "num_clients=10", "participation=0.5",
              "partition=classes", "partition.k=2", "rounds=4", "local.lr=0.05"]
    models, _ = same_bits_on_ray_and_in_process(tmp_path, common, (1, 3))
    assert main([*common, "rounds=2", "checkpoint_every=2", f"output_dir={tmp_path}", "run_name=part", "--quiet"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "--quiet"]) == 0
    resumed = torch.load(tmp_path / "part" / "model.pt", weights_only=True)["global"]
    assert all(torch.equal(models[0][k], resumed[k]) for k in resumed)
    last = {r: pq.read_table(tmp_path / r / "metrics.parquet").to_pylist()[-1]["personal_accuracy"]
            for r in ("a1", "a3", "part")}
    assert last["a1"] == last["a3"] == last["part"], last
    assert main([*common, *learn, f"output_dir={tmp_path}", "run_name=learn", "--quiet"]) == 0
    curve = [r["personal_accuracy"] for r in pq.read_table(tmp_path / "learn" / "metrics.parquet").to_pylist()]
    assert curve[-1] > reaches and curve[-1] > curve[0] + 0.2, curve
