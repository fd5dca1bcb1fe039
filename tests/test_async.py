"""Asynchronous FL on the virtual clock (algorithms/fedbuff.py, fedasync.py,
runtime/asynchronous.py): the staleness weights against the papers' formulas, FedBuff's
buffer flushes on a three-client case worked out by hand, and runs bit-identical across 1
and 3 actors and across a resume."""
import math

import pyarrow.parquet as pq
import pytest
import torch

from raysim.run import main


def test_staleness_weights_are_the_papers():
    from raysim.algorithms._asynchronous import staleness_weight

    for tau in range(0, 12):
        assert staleness_weight("sqrt", tau) == pytest.approx(1 / math.sqrt(1 + tau))  # FedBuff, Sec. 4
        assert staleness_weight("poly", tau, a=0.5) == pytest.approx((tau + 1) ** -0.5)  # FedAsync, Sec. 5.2
        assert staleness_weight("hinge", tau, a=10, b=4) == pytest.approx(1.0 if tau <= 4 else 1 / (10 * (tau - 4) + 1))
        assert staleness_weight("constant", tau) == 1.0


def _model(path):
    return torch.load(path / "model.pt", weights_only=True)["global"]


def test_fedbuff_flushes_by_hand(ray_local, tmp_path):
    """Three clients, all training at once from t = 0 (concurrency 3), equal shards, compute
    only (links of 10^6 Mbit/s, no latency): speeds 1 : 0.4 : 0.1 give durations d, 2.5 d,
    10 d. Buffer K = 2. Round 1: client 0 arrives at d (version 0, staleness 0), starts again
    from version 0 (no flush yet), arrives at 2 d (staleness 0): flush, version 1, the round
    ends at 2 d. Round 2: client 0 starts at 2 d from version 1; client 1 arrives at 2.5 d
    (trained from version 0: staleness 1), restarts; client 0 arrives at 3 d (staleness 0):
    flush, the round ends at 3 d. Client 2 is still training."""
    (tmp_path / "devices.csv").write_text("gflops,down_mbps,up_mbps,latency_s\n"
                                          "0.001,1000000,1000000,0\n0.0004,1000000,1000000,0\n"
                                          "0.0001,1000000,1000000,0\n")
    assert main(["dataset=digits", "model=mclr", "num_clients=3", "partition=contiguous", "rounds=2",
                 "algorithm=fedbuff", "fedbuff.concurrency=3", "fedbuff.buffer=2", "system.profile=trace",
                 f"system.trace={tmp_path / 'devices.csv'}", f"output_dir={tmp_path}", "run_name=r", "--quiet"]) == 0
    rows = pq.read_table(tmp_path / "r" / "metrics.parquet").to_pylist()
    clients = [c for c in pq.read_table(tmp_path / "r" / "clients.parquet").to_pylist()
               if c["method"] == "client_update"]
    d = {c["cid"]: c["sim_seconds"] for c in clients}
    assert d[1] == pytest.approx(2.5 * d[0], rel=1e-3)  # equal shards: durations by speed
    assert [(c["round"], c["cid"]) for c in clients] == [(1, 0), (1, 0), (2, 1), (2, 0)]
    assert [(r["staleness_mean"], r["staleness_max"]) for r in rows] == [(0.0, 0), (0.5, 1)]
    assert rows[0]["sim_end"] == pytest.approx(2 * d[0], rel=1e-6)
    assert rows[1]["sim_start"] == rows[0]["sim_end"] and rows[1]["sim_end"] == pytest.approx(3 * d[0], rel=1e-6)


@pytest.mark.parametrize("algorithm", ["fedbuff", "fedasync"])
def test_async_runs_are_bit_identical_across_actors_and_resume_and_learn(ray_local, tmp_path, algorithm):
    """The same asynchronous run on 1 and 3 client actors, and stopped after round 4 then
    resumed to round 8 (the clients in flight at the checkpoint are sent again), gives the
    same model and simulated times, bit for bit; and it learns (digits, 20 clients, mobile
    devices)."""
    common = ["dataset=digits", "model=mclr", "num_clients=20", "local.lr=0.1", f"algorithm={algorithm}",
              f"{algorithm}.concurrency=6", "system.profile=mobile", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=8", "resources.num_actors=1", "run_name=one"]) == 0
    assert main([*common, "rounds=8", "resources.num_actors=3", "run_name=three"]) == 0
    assert main([*common, "rounds=4", "resources.num_actors=2", "checkpoint_every=4", "run_name=half"]) == 0
    assert torch.load(tmp_path / "half" / "checkpoint.pt", weights_only=False)["flight"]["flights"]  # in flight
    assert main(["--quiet", f"resume={tmp_path / 'half'}", "rounds=8"]) == 0
    one = _model(tmp_path / "one")
    for other in ("three", "half"):
        m = _model(tmp_path / other)
        assert all(torch.equal(one[k], m[k]) for k in one), other
    rows = pq.read_table(tmp_path / "one" / "metrics.parquet").to_pylist()
    half = pq.read_table(tmp_path / "half" / "metrics.parquet").to_pylist()
    assert [r["sim_end"] for r in half] == [r["sim_end"] for r in rows]
    assert rows[-1]["accuracy"] > 0.6, rows[-1]  # from 0.1 (10 classes): it learns
    assert max(r["staleness_max"] for r in rows) >= 1  # updates did arrive stale


# ---- issue 54: the server's update values, and runs that lose clients ---------------------------


def _replayed(algorithm: str, arrivals_of, *more: str):
    """The algorithm's server half on a server whose arrivals are hand-made
    (`arrivals_of(algorithm)` builds them): the values of its update can be worked out by
    hand. Returns (algorithm, the model before, the arrivals it asked for, by call)."""
    from raysim.config import load_config
    from raysim.testing import InProcessServer
    from raysim.training import cpu_state

    cfg = load_config(overrides=[f"algorithm={algorithm}", "model=mclr", "num_clients=3", *more])
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    s = InProcessServer(cfg, [(x[:2], torch.tensor([0, 1]))] * 3, 2)
    s.setup()
    algo = s.algorithm
    algo.version = 3
    queue, asked = arrivals_of(cpu_state(algo.model)), []

    def arrivals(rnd, n, concurrency, payload):
        asked.append(n)
        for _ in range(n):
            yield queue.pop(0)

    s.arrivals = arrivals
    return algo, s, asked


def _arrival(cid, version, base, delta, loss=1.0):
    from raysim.contract import ClientResult
    from raysim.runtime.asynchronous import Arrival

    result = None if delta is None else ClientResult(cid, 2, {k: base[k] + d for k, d in delta.items()}, {"loss": loss})
    return Arrival(cid, result, version, 0.0, 1.0, {"weights": base})


def test_fedbuff_applies_the_mean_of_k_staleness_weighted_updates_and_waits_for_k():
    """K = 2; three arrivals: client 0 (trained from the current version 3: tau 0), client 1
    (went offline: no update), client 2 (trained from version 1, an older model: tau 2). The
    step: w + (1/2) (1 (x_0 - w) + (1/sqrt 3) (x_2 - w_1)). The offline client is not one
    of the K: the server asks for another arrival. (A FedScale-style sum s x / sum s, or a
    division by the one update that arrived, gives other values.)"""
    d0, d2 = {"head.weight": 0.3, "head.bias": -0.2}, {"head.weight": -0.6, "head.bias": 0.9}

    def arrivals_of(w):
        old = {k: v - 0.1 for k, v in w.items()}  # version 1
        return [_arrival(0, 3, w, d0), _arrival(1, 2, w, None), _arrival(2, 1, old, d2)]

    algo, s, asked = _replayed("fedbuff", arrivals_of, "fedbuff.buffer=2")
    from raysim.training import cpu_state

    w = cpu_state(algo.model)
    row = algo.run_round(1, s)
    now = cpu_state(algo.model)
    for k in w:
        want = w[k] + 0.5 * (d0[k] + d2[k] / math.sqrt(3))
        assert torch.allclose(now[k], want, atol=1e-6), k
    assert asked == [2, 1] and algo.version == 4
    assert (row["staleness_mean"], row["staleness_max"]) == (1.0, 2)


def test_fedbuff_fedscale_reading_averages_whole_models_and_drops_the_too_stale():
    """FedScale's aggregator: sum s x / sum s with s = 1/(1 + tau), arrivals over
    max_staleness dropped (not counted in K)."""
    d0, d2 = {"head.weight": 0.3, "head.bias": -0.2}, {"head.weight": -0.6, "head.bias": 0.9}

    def arrivals_of(w):
        old = {k: v - 0.1 for k, v in w.items()}
        return [_arrival(0, 2, w, d0), _arrival(1, 0, w, d2), _arrival(2, 1, old, d2)]

    algo, s, asked = _replayed("fedbuff", arrivals_of, "fedbuff.buffer=2", "fedbuff.reading=fedscale",
                               "fedbuff.max_staleness=2")
    from raysim.training import cpu_state

    w = cpu_state(algo.model)
    row = algo.run_round(1, s)
    now = cpu_state(algo.model)
    for k in w:  # tau 1 (weight 1/2) and tau 2 (weight 1/3); client 1's tau 3 > 2: dropped
        x0, x2 = w[k] + d0[k], w[k] - 0.1 + d2[k]
        assert torch.allclose(now[k], (x0 / 2 + x2 / 3) / (1 / 2 + 1 / 3), atol=1e-6), k
    assert asked == [2, 1] and row["dropped_stale"] == 1


def test_fedasync_mixes_each_update_in_by_its_staleness():
    """alpha 0.6, poly a = 0.5: client 0 (tau 0) mixes in with 0.6, making version 4; then
    client 2, trained from version 2 (tau 2), with 0.6 / sqrt 3; an offline client between
    them brings nothing and is not counted."""
    d0, d2 = {"head.weight": 0.3, "head.bias": -0.2}, {"head.weight": -0.6, "head.bias": 0.9}

    def arrivals_of(w):
        return [_arrival(0, 3, w, d0), _arrival(1, 3, w, None), _arrival(2, 2, w, d2)]

    algo, s, asked = _replayed("fedasync", arrivals_of, "fedasync.updates_per_round=2")
    from raysim.training import cpu_state

    w = cpu_state(algo.model)
    algo.run_round(1, s)
    now = cpu_state(algo.model)
    a2 = 0.6 / math.sqrt(3)
    for k in w:
        w1 = 0.4 * w[k] + 0.6 * (w[k] + d0[k])
        assert torch.allclose(now[k], (1 - a2) * w1 + a2 * (w[k] + d2[k]), atol=1e-6), k
    assert algo.version == 5 and asked == [1, 1, 1]


def test_fedasync_trains_on_the_papers_regularised_objective():
    """The client's loss is f(x) + rho/2 ||x - x_tau||^2 around the model it downloaded."""
    from raysim.config import load_config
    from raysim.testing import InProcessServer

    x, y = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 1, 0])
    got = {}
    for rho in (0.0, 2.0):
        cfg = load_config(overrides=["algorithm=fedasync", "model=mclr", "num_clients=1", f"fedasync.rho={rho}",
                                     "local.batch_size=4", "local.lr=0.5", "local.momentum=0", "local.weight_decay=0",
                                     "local.epochs=2"])
        s = InProcessServer(cfg, [(x, y)], 2)
        s.setup()
        payload = {"weights": {k: v.clone() for k, v in s.algorithm.model.state_dict().items()}}
        (r,) = s.run_clients(1, [0], payload)
        got[rho] = (payload["weights"], r.update)
    w0, plain = got[0.0]
    _, prox = got[2.0]
    # by hand: two full-batch steps with and without the pull towards w0
    p, q = {k: v.clone() for k, v in w0.items()}, {k: v.clone() for k, v in w0.items()}
    for _ in range(2):
        for params, rho in ((p, 0.0), (q, 2.0)):
            t = {k: v.clone().requires_grad_(True) for k, v in params.items()}
            loss = torch.nn.functional.cross_entropy(x @ t["head.weight"].T + t["head.bias"], y)
            loss = loss + 0.5 * rho * sum(((t[k] - w0[k]) ** 2).sum() for k in t)
            g = torch.autograd.grad(loss, list(t.values()))
            for (k, _), gk in zip(t.items(), g):
                params[k] = params[k] - 0.5 * gk
    for k in w0:
        assert torch.allclose(plain[k], p[k], atol=1e-6) and torch.allclose(prox[k], q[k], atol=1e-6), k
        assert not torch.allclose(plain[k], prox[k], atol=1e-4)


def _main_within(capfd, args, seconds=240):
    """The command in this process on the session's Ray, with its warm workers: (exit
    status, stderr). A run that hangs (these runs used to loop for ever) fails the test
    after `seconds` instead of hanging the suite: the alarm's exception ends the run, whose
    processes, as any failed run's, are not kept."""
    import signal

    def late(*_):
        raise TimeoutError(f"the run did not end in {seconds} s")

    capfd.readouterr()
    before = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        code = main([*args, "--quiet"])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    return code, capfd.readouterr().err


@pytest.mark.parametrize("algorithm", ["fedbuff", "fedasync"])
def test_async_runs_with_dropouts_end_and_log_each_dropout_once(ray_local, tmp_path, capfd, algorithm):
    """4 clients, 3 training at once, half of them dropping out each round (fixed per seed,
    round and client): the run ends (it used to pick the same dropped clients for ever), a
    dropped client is recorded once a round, and every round takes its full count of
    updates."""
    n = 2
    per = "fedbuff.buffer" if algorithm == "fedbuff" else "fedasync.updates_per_round"
    code, err = _main_within(capfd, ["dataset=digits", "model=mclr", "num_clients=4", "rounds=6",
                                     f"algorithm={algorithm}", f"{algorithm}.concurrency=3", f"{per}={n}",
                                     "system.dropout=0.5", f"output_dir={tmp_path}", "run_name=r"])
    assert code == 0, err
    calls = [c for c in pq.read_table(tmp_path / "r" / "clients.parquet").to_pylist() if c["method"] == "client_update"]
    dropped = [(c["round"], c["cid"]) for c in calls if c["status"] == "dropped"]
    assert dropped and len(dropped) == len(set(dropped))
    ok = [c["round"] for c in calls if c["status"] == "ok"]
    assert [ok.count(r) for r in range(1, 7)] == [n] * 6


def test_an_async_run_that_cannot_go_on_says_so(ray_local, tmp_path, capfd):
    """Every client drops out (dropout 0.99, 3 clients; seed 0 leaves none in round 1), or
    every client goes offline before its update is back (online 1 ms a day): the run stops
    with one line, exit 3, its summary saying `stalled`."""
    (tmp_path / "on.csv").write_text("client,start_s,end_s\n0,0,0.001\n0,86400,86400.001\n")
    for name, more in (("drop", ["system.dropout=0.99"]),
                       ("offline", ["system.profile=uniform", "system.availability=trace",
                                    f"system.availability_trace={tmp_path / 'on.csv'}"])):
        code, err = _main_within(capfd, ["dataset=digits", "model=mclr", "num_clients=3", "rounds=3",
                                         "algorithm=fedbuff", "fedbuff.concurrency=2", "fedbuff.buffer=2", *more,
                                         f"output_dir={tmp_path}", f"run_name={name}"])
        assert code == 3, (name, err)
        assert "cannot go on" in err and "Traceback" not in err and err.count("\n") == 1, err
        summary = __import__("json").loads((tmp_path / name / "summary.json").read_text())
        assert summary["status"] == "stalled" and summary["stalled_round"] == 1


def test_fedbuff_waits_for_k_updates_when_clients_go_offline(ray_local, tmp_path):
    """Clients 0-3 are always online; client 4 only for its first 50 ms, less than its
    training: it arrives offline in round 1, untrained. Each round still applies K = 3
    updates (the offline one used to count towards K)."""
    rows = ["client,start_s,end_s"] + [f"{c},0,100000000" for c in range(4)] + ["4,0,0.05"]
    (tmp_path / "on.csv").write_text("\n".join(rows) + "\n")
    assert main(["dataset=digits", "model=mclr", "num_clients=5", "rounds=3", "algorithm=fedbuff",
                 "fedbuff.concurrency=5", "fedbuff.buffer=3", "system.profile=uniform", "system.availability=trace",
                 f"system.availability_trace={tmp_path / 'on.csv'}", f"output_dir={tmp_path}", "run_name=r",
                 "--quiet"]) == 0
    calls = [c for c in pq.read_table(tmp_path / "r" / "clients.parquet").to_pylist() if c["method"] == "client_update"]
    assert any(c["cid"] == 4 and c["reason"] == "offline" for c in calls)
    ok = [c["round"] for c in calls if c["status"] == "ok"]
    assert [ok.count(r) for r in (1, 2, 3)] == [3, 3, 3]


@pytest.mark.parametrize("algorithm", ["fedbuff", "fedasync"])
def test_uniform_picks_from_the_free_clients_tree_are_the_listed_picks(ray_local, tmp_path, algorithm):
    """`selection=random` with always-online clients draws each arrival's client from
    `FreeClients` (O(log n)); a subclass of it takes the general path, which lists the free
    clients on every arrival. Same clients started in the same order, same dropouts, same
    model, bit for bit (with dropouts and a resume in the first run)."""
    common = [f"algorithm={algorithm}", "dataset=digits", "model=mclr", "num_clients=40", "rounds=6",
              "system.dropout=0.2", "checkpoint_every=3", "plugins=[stateful_plugin]", f"output_dir={tmp_path}",
              # newcomers in rounds 2 and 3: the tree is made again then (and after the resume), carried over
              "clients.join.fraction=0.25", "clients.join.round=2", "clients.join.over=2",
              "--quiet"]
    assert main([*common, "selection=random", "rounds=3", "run_name=tree"]) == 0
    assert main([f"resume={tmp_path / 'tree'}", "rounds=6", "plugins=[stateful_plugin]", "--quiet"]) == 0
    assert main([*common, "selection=test_uniform_listed", "run_name=listed"]) == 0
    rows = {n: [(r["round"], r["cid"], r["status"]) for r in pq.read_table(tmp_path / n / "clients.parquet").to_pylist()]
            for n in ("tree", "listed")}
    assert rows["tree"] == rows["listed"] and any(s == "dropped" for _, _, s in rows["tree"])
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("tree", "listed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_clients_there_are_listed_once_until_more_join():
    """`Availability.available` hands out one list per set of clients there (an asynchronous
    run at 100,000 clients listed them every round), the right clients each round."""
    from raysim.config import load_config
    from raysim.world.availability import Availability

    cfg = load_config(overrides=["num_clients=12", "clients.join.fraction=0.5", "clients.join.round=3",
                                 "clients.join.over=2"])
    there = Availability(cfg, 12)
    lists = [there.available(r) for r in range(1, 7)]
    for r, listed in enumerate(lists, start=1):
        assert listed == [c for c in range(12) if there.joins[c] <= r]
    assert lists[0] is lists[1] and lists[2] is not lists[1] and lists[3] is not lists[2] and lists[4] is lists[3]
    assert [len(x) for x in lists] == [6, 6, 9, 12, 12, 12]


def test_free_clients_as_arrays_for_millions_find_what_the_lists_find(monkeypatch):
    """`FreeClients` past `LISTED` clients keeps numpy arrays (15 million clients: no Python
    int per client) and a range of every client as a range: the same k-th free client after
    the same starts and returns as its lists over a sorted list of ids."""
    import random

    from raysim.runtime import asynchronous

    n, taken = 3000, {5, 17, 2999, 1000}
    listed = asynchronous.FreeClients(list(range(n)), taken)
    monkeypatch.setattr(asynchronous, "LISTED", 10)
    arrays = asynchronous.FreeClients(range(n), taken)
    assert isinstance(arrays.there, range) and not isinstance(arrays.tree, list)
    rng = random.Random(0)
    for _ in range(300):
        cid, free = rng.randrange(n), rng.random() < 0.5
        listed.set(cid, free)
        arrays.set(cid, free)
        assert arrays.count == listed.count
        k = rng.randrange(listed.count)
        assert arrays.kth(k) == listed.kth(k)
    assert arrays._position(n) is None and arrays._position(-1) is None
