"""Adversarial clients (raysim/attacks.py): who attacks, what each attack sends, the
config's refusals, and robust aggregation doing its job against them on real training."""
import pyarrow.parquet as pq
import pytest
import torch

from raysim.attacks import Adversaries, attackers
from raysim.config import ConfigError, load_config
from raysim.contract import Client, ClientResult
from raysim.run import main
from raysim.testing import InProcessServer


def cfg(*overrides):
    return load_config(overrides=["num_clients=8", *overrides])


def test_attackers_are_a_seed_fixed_share_and_none_without_a_kind():
    c = cfg("attack.kind=sign_flip", "attack.fraction=0.25")
    who = attackers(c, 8)
    assert len(who) == 2 and who == attackers(c, 8)
    assert attackers(cfg(), 8) == set()
    assert len(attackers(cfg("attack.kind=label_flip", "attack.fraction=0.01"), 8)) == 1  # at least one


def client(cid=0, y=(0, 1, 2)):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    return Client(cid, 3, cfg(), torch.zeros(3, 2), torch.tensor(y), 3, torch.device("cpu"),
                  torch.Generator().manual_seed(0), {}, model)


def attacked(kind, **kw):
    c = cfg(f"attack.kind={kind}", "attack.fraction=0.5", *[f"attack.{k}={v}" for k, v in kw.items()])
    adv = Adversaries(c, 8)
    cid = min(adv.who)
    sent = {"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2), "1.weight": torch.ones(2), "1.bias": torch.zeros(2),
            "1.running_mean": torch.zeros(2), "1.running_var": torch.ones(2), "1.num_batches_tracked": torch.tensor(0)}
    trained = {k: (v + 2 if v.is_floating_point() else v + 1) for k, v in sent.items()}
    result = adv.after(client(cid), {"weights": sent}, ClientResult(cid, 3, dict(trained), {"loss": 0.0}), 3,
                       "client_update")
    return sent, trained, result


def test_model_attacks_change_the_trainable_parameters_only():
    sent, trained, r = attacked("sign_flip")
    assert torch.equal(r.update["0.weight"], sent["0.weight"] - 2) and r.metrics["attacked"]
    assert torch.equal(r.update["1.running_var"], trained["1.running_var"])  # buffers as trained
    _, _, r = attacked("scaled", boost=10)
    assert torch.equal(r.update["0.bias"], torch.full((2,), 20.0))
    _, _, a = attacked("gaussian", scale=0.5)
    _, _, b = attacked("gaussian", scale=0.5)
    assert torch.equal(a.update["0.weight"], b.update["0.weight"])  # drawn from (seed, round, client)
    assert not torch.equal(a.update["0.weight"], trained["0.weight"])


def test_label_flip_flips_an_attackers_labels_in_training_calls_from_its_start_round():
    adv = Adversaries(cfg("attack.kind=label_flip", "attack.fraction=0.5", "attack.start=3", "rounds=5"), 8)
    bad, good = min(adv.who), min(set(range(8)) - adv.who)
    for cid, rnd, method, expect in [(bad, 3, "client_update", [2, 1, 0]), (bad, 2, "client_update", [0, 1, 2]),
                                     (bad, 3, "label_counts", [0, 1, 2]), (good, 3, "client_update", [0, 1, 2])]:
        c = client(cid)
        adv.before(c, rnd, method)
        assert c.y.tolist() == expect, (cid, rnd, method)


@pytest.mark.parametrize("overrides,message", [
    (["algorithm=scaffold", "attack.kind=sign_flip", "attack.fraction=0.2"],
     "attack.kind=sign_flip changes the model a client returns, but algorithm 'scaffold' returns something else"),
    (["attack.kind=label_flip"], "attack.kind=label_flip needs attack.fraction > 0"),
    (["attack.kind=backdoor", "attack.fraction=0.1"], "attack.kind must be one of none, label_flip, sign_flip"),
    (["attack.kind=scaled", "attack.fraction=1.0"], "attack.fraction must be in [0, 1)"),
])
def test_bad_attack_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        cfg(*overrides)
    assert message in str(e.value)
    cfg("algorithm=scaffold", "attack.kind=label_flip", "attack.fraction=0.2")  # labels: any algorithm


def test_robust_aggregation_holds_where_the_mean_breaks():
    """Digits, 10 clients all training each round, 3 of them sending boosted updates."""
    torch.set_num_threads(1)
    common = ["dataset=digits", "num_clients=10", "participation=1.0", "rounds=5", "partition=iid",
              "attack.kind=scaled", "attack.boost=10", "attack.fraction=0.3"]
    acc = {}
    for agg in ("mean", "median", "trimmed_mean", "krum"):
        extra = ["server.trim=0.3"] if agg == "trimmed_mean" else ["server.byzantine=3"] if agg == "krum" else []
        run = InProcessServer.from_config(load_config(overrides=[*common, f"server.aggregator={agg}", *extra])).run()
        acc[agg] = run[-1]["accuracy"]
    clean = InProcessServer.from_config(load_config(overrides=[*common[:5]])).run()[-1]["accuracy"]
    assert acc["mean"] < clean - 0.3, (acc, clean)
    for agg in ("median", "trimmed_mean", "krum"):
        assert acc[agg] > clean - 0.1, (agg, acc, clean)


def test_a_run_records_who_attacked(ray_local, tmp_path):
    assert main(["dataset=digits", "num_clients=8", "participation=0.5", "rounds=3", "attack.kind=label_flip",
                 "attack.fraction=0.25", "attack.start=2", f"output_dir={tmp_path}", "run_name=a", "--quiet"]) == 0
    who = attackers(load_config(overrides=["num_clients=8", "attack.kind=label_flip", "attack.fraction=0.25"]), 8)
    rows = [r for r in pq.read_table(tmp_path / "a" / "clients.parquet").to_pylist() if r["method"] == "client_update"]
    assert {(r["round"], r["cid"]) for r in rows if r["attacker"]} == \
        {(r["round"], r["cid"]) for r in rows if r["cid"] in who and r["round"] >= 2}
    metrics = pq.read_table(tmp_path / "a" / "metrics.parquet").to_pylist()
    assert [m["attackers"] for m in metrics] == [sum(r["attacker"] for r in rows if r["round"] == m["round"])
                                                 for m in metrics]
