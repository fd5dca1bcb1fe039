"""A population made when it is picked (`synthetic.generate=lazy`, issue 73): the same
samples, clients, models and metrics as the same users made at start (`per_user`), and a
run whose memory does not grow with its number of clients beyond a few bytes each."""
import json
import pickle
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from raysim.config import ConfigError, load_config
from raysim.data.datasets import Synthetic
from raysim.data.partition import label_counts
from raysim.data.population import MadeOnDemand
from raysim.experiment import prepare
from raysim.run import main

USERS = ["dataset=synthetic", "partition=natural", "model=mclr", "synthetic.samples_per_client=12",
         "synthetic.max_samples_per_client=30", "synthetic.test_users=9"]


def both(n: int = 60, *more):
    """(per_user, lazy): the dataset and partition of the same n users made both ways."""
    return [prepare(load_config(overrides=[*USERS, f"num_clients={n}", f"synthetic.generate={g}", *more]))
            for g in ("per_user", "lazy")]


def test_made_rows_are_the_rows_of_the_users_made_at_start():
    (made, part_m, c), (lazy, part_l, _) = both()
    assert lazy.x_train.shape == made.x_train.shape and lazy.y_train.shape == made.y_train.shape
    rows = np.random.default_rng(0).integers(0, len(made.y_train), 300)  # unsorted, repeated, many users
    assert np.array_equal(lazy.x_train[rows], made.x_train[rows])
    assert np.array_equal(lazy.y_train[rows], made.y_train[rows])
    for k in (0, 31, 59):  # the partition: each user's own rows, in the same order
        assert np.array_equal(part_l.train[k], part_m.train[k])
    assert np.array_equal(part_l.sizes(), part_m.sizes())
    # the global test set: the 9 drawn users' test splits, in user order; the rest stay local
    tested = made.global_test
    assert np.array_equal(lazy.x_test, made.x_test[tested]) and np.array_equal(lazy.y_test, made.y_test[tested])
    assert len(np.unique(lazy.users_test)) == 9 and len(np.unique(made.users_test)) == 60
    pop = pickle.loads(pickle.dumps(lazy.population))  # as the client actors get it
    cids = [3, 59, 0]
    assert np.array_equal(pop.label_counts(cids), label_counts(made.y_train, part_m, c)[cids])
    x, y = pop.test(42)
    assert np.array_equal(x, made.x_test[made.users_test == 42]) and np.array_equal(y, made.y_test[made.users_test == 42])
    with pytest.raises(MadeOnDemand, match="synthetic.generate=per_user"):
        np.asarray(lazy.x_train)


def test_lazy_needs_the_users_partition_and_a_test_sample_at_scale():
    with pytest.raises(ConfigError, match="partition.name=natural"):
        load_config(overrides=["dataset=synthetic", "partition=iid", "synthetic.generate=lazy"])
    with pytest.raises(ConfigError, match="synthetic.test_users"):
        load_config(overrides=["dataset=synthetic", "partition=natural", "num_clients=200000",
                               "synthetic.samples_per_client=20", "synthetic.generate=lazy"])
    with pytest.raises(ConfigError, match="eval.local_clients"):
        load_config(overrides=["dataset=synthetic", "partition=natural", "num_clients=200000", "synthetic.test_users=10",
                               "synthetic.samples_per_client=20", "synthetic.generate=lazy"])
    with pytest.raises(ConfigError, match="synthetic.test_users=50 is more than the 40 users"):
        load_config(overrides=["dataset=synthetic", "partition=natural", "num_clients=40", "synthetic.test_users=50"])


def _run(tmp_path, name: str, *over) -> tuple[dict, list, list]:
    assert main([*USERS, "num_clients=2000", "clients_per_round=50", "rounds=3", "eval_every=1",
                 "eval.local_clients=40", "local.epochs=2", f"output_dir={tmp_path}", f"run_name={name}", *over,
                 "--quiet"]) == 0
    d = tmp_path / name
    summary = json.loads((d / "summary.json").read_text())
    metrics = pq.read_table(d / "metrics.parquet").to_pylist()
    clients = [(r["round"], r["cid"], r["method"], r.get("accuracy"), r.get("num_samples"))
               for r in pq.read_table(d / "clients.parquet").to_pylist()]
    return summary, metrics, clients


KEPT = ("round", "accuracy", "loss", "local_accuracy", "local_accuracy_mean", "local_accuracy_min", "selected",
        "cohort_entropy", "clients")


@pytest.mark.parametrize("vectorize", [[], ["local.vectorize=true", "local.vectorize_group=16"],
                                       ["local.vectorize=true", "attack.kind=label_flip", "attack.fraction=0.3"]],
                         ids=["sequential", "vectorised", "vectorised-label-flip"])
def test_a_lazy_run_picks_trains_and_evaluates_the_same_clients_with_the_same_bits(ray_local, tmp_path, vectorize):
    """2,000 users made when picked, trained by two client actors, against the same users made at
    start and trained by one: the same cohorts, models (hash), global and per-client metrics;
    vectorised too, with label-flipping attackers in the groups."""
    made = _run(tmp_path, "made", "synthetic.generate=per_user", "resources.num_actors=1", *vectorize)
    lazy = _run(tmp_path, "lazy", "synthetic.generate=lazy", "resources.num_actors=2", *vectorize)
    assert lazy[0]["model_sha256"] == made[0]["model_sha256"]
    rows = [[{k: r.get(k) for k in KEPT} for r in run[1]] for run in (made, lazy)]
    assert rows[0] == rows[1] and len(rows[0]) == 3 and all(r["local_accuracy"] is not None for r in rows[0])
    assert lazy[2] == made[2] and sum(1 for r in made[2] if r[2] == "evaluate") == 3 * 40
    assert made[0]["final_accuracy"] > 0.12  # it learns (10 classes)


def test_the_cohorts_label_mix_comes_from_the_clients_reports_and_only_the_silent_are_made_again():
    """The server sums the label counts its clients reported with their updates; only a client
    that did not report (dropped, lost) is made again, and the sum is the made users' sum."""
    from raysim.runtime.client_actor import _label_counts
    from raysim.runtime.server import cohort_label_counts

    made, lazy = both(40)
    population = lazy[0].population
    asked = []

    def counts_of(cids):
        asked.extend(cids)
        return population.label_counts(cids)

    cohort = [3, 7, 11, 20, 33]
    reports = [Labelled(population.train(c)[1]) for c in cohort[:3]]  # 20 and 33 did not report
    reported = dict(zip(cohort[:3], _label_counts(reports, population.num_classes)))
    total = cohort_label_counts(cohort, counts_of, reported)
    assert asked == [20, 33]
    assert total.tolist() == label_counts(made[0].y_train, made[1], population.num_classes)[cohort].sum(0).tolist()
    assert total.sum() == sum(population.sizes[c] - population.test_sizes[c] for c in cohort)
    table = label_counts(made[0].y_train, made[1], population.num_classes)
    assert cohort_label_counts(cohort, table, {}).tolist() == total.tolist()  # a table held whole: its rows


@pytest.mark.parametrize("vectorize", [False, True])
def test_clients_of_a_population_report_their_true_label_counts_with_their_updates(vectorize):
    """The client actor's runner, in this process, on users made when picked: each update carries
    the client's training-label counts, its true ones even where a label-flipping attacker trains
    on flipped labels; a group's sum carries them in its clients' lines."""
    from omegaconf import OmegaConf

    from raysim.models import build_model
    from raysim.runtime.client_actor import ClientRunner
    from raysim.wire import pack, unpack

    over = ["num_clients=40", "attack.kind=label_flip", "attack.fraction=0.5", "synthetic.generate=lazy"]
    if vectorize:
        over += ["local.vectorize=true", "local.vectorize_group=4"]
    cfg = load_config(overrides=[*USERS, *over])
    data, part, n_classes = prepare(cfg)
    runner = ClientRunner(here=True)
    runner.fetch = lambda refs: refs
    runner._attach(OmegaConf.to_container(cfg), [{"population": data.population}, part.train], n_classes, data.norm,
                   data.pixel_max)
    model = build_model(cfg.model, data.input_shape, n_classes)
    cids = [2, 5, 11, 17]
    assert any(runner.adversaries.attacking(c, 1, "client_update") for c in cids)  # the flips are there to hide
    out = runner.run(None, 1, "client_update", "algorithm", cids, [1] * 4, 4, [4] if vectorize else None, vectorize,
                     vectorize, pack({"weights": model.state_dict()}))
    results = [unpack(r) for r in out]
    lines = (results[0].clients if vectorize else [(r.cid, r.num_samples, r.metrics, None) for r in results])
    truth = data.population.label_counts(cids)
    assert [cid for cid, *_ in lines] == cids
    for (cid, n, metrics, _), counts in zip(lines, truth):
        assert metrics["label_counts"].tolist() == counts.tolist() and n == counts.sum()


class Labelled:
    """What `_label_counts` reads of a client: its labels and their number."""

    def __init__(self, y):
        import torch

        self.y = torch.from_numpy(np.asarray(y))
        self.num_samples = len(self.y)


def _peak_kb(tmp_path, n: int) -> int:
    """Peak resident memory (KB) of a 3-round run of n lazy users, 100 a round, in its own process."""
    run = [sys.executable, "-m", "raysim.run", "dataset=synthetic", "partition=natural", "model=mclr",
           f"num_clients={n}", "clients_per_round=100", "rounds=3", "synthetic.samples_per_client=20",
           "synthetic.generate=lazy", "synthetic.test_users=500", "eval.local_clients=100",
           f"output_dir={tmp_path}", f"run_name=n{n}", "--quiet"]
    probe = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
             "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, *run], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    rc, kb = out.stdout.split()[-2:]
    assert rc == "0", out.stderr[-2000:]
    return int(kb)


BYTES_PER_CLIENT = 64  # a user's size and test size (4 + 4), its offset (8), its partition size (8): 24 measured


def test_a_million_clients_cost_a_few_bytes_each(tmp_path):
    """10,000 and 1,000,000 users, in the command's own process: the peak memory grows by less
    than BYTES_PER_CLIENT a client (FedProx's Synthetic made at start would need 1.9 GB more)."""
    small, big = _peak_kb(tmp_path, 10_000), _peak_kb(tmp_path, 1_000_000)
    per_client = (big - small) * 1024 / 990_000
    assert per_client < BYTES_PER_CLIENT, f"{per_client:.0f} bytes a client ({small} KB -> {big} KB)"
    summary = json.loads((tmp_path / "n1000000" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["local_eval_clients"] == 100


def test_stored_users_one_after_another_are_an_offset_each():
    """A natural partition of samples stored user after user (LEAF's, Synthetic's) holds one
    offset per user and no index array; unsorted owners keep their index array. The same shards."""
    from raysim.data.partition import natural, split_by_owner

    users = np.repeat(np.arange(5), [3, 1, 4, 2, 2])
    shards = natural(np.zeros(len(users)), 5, None, None, 10, users)
    assert shards._order is None and shards.offsets.tolist() == [0, 3, 4, 8, 10, 12]
    assert all(np.array_equal(a, b) for a, b in zip(shards, split_by_owner(users, 5)))
    mixed = users[::-1].copy()
    kept = natural(np.zeros(len(users)), 5, None, None, 10, mixed)
    assert all(np.array_equal(a, b) for a, b in zip(kept, split_by_owner(mixed, 5)))
