"""DP (raysim/privacy/), central and local: clipping bounds each client's (each sample's)
contribution, the noise has the stated scale and is reproducible, the accountants give
dp-accounting's values, runs are bit-identical across packing and resume, and what cannot
be private is refused."""
import math

import pytest
import torch

from raysim.aggregation import ServerRule
from raysim.config import ConfigError, load_config
from raysim.privacy.central import CentralDP
from raysim.run import main

pytest.importorskip("dp_accounting")


def rule(clip=1.0, z=0.0, k=4, seed=0):
    return ServerRule(load_config().server, {"w"}, privacy=CentralDP(clip, z, k, seed))


def test_clipping_bounds_every_clients_contribution():
    """Without noise the step is the sum of the clipped updates over K: each client moves the
    model by at most clip / K, an update already inside the bound goes in unchanged, and the
    clients' sample counts do not weigh (DP-FedAvg's uniform weights)."""
    current = {"w": torch.tensor([1.0, 2.0, 3.0])}
    big = {"w": current["w"] + torch.tensor([30.0, -40.0, 0.0])}  # update norm 50
    small = {"w": current["w"] + torch.tensor([0.3, 0.0, -0.4])}  # update norm 0.5
    for state, weight in ((big, 1000.0), (small, 1.0)):
        fold = rule(clip=2.0, k=4).round(current, 1)
        fold.add(state, weight)
        step = fold.result(current)["w"] - current["w"]
        assert float(step.norm()) <= 2.0 / 4 + 1e-6
    fold = rule(clip=2.0, k=4).round(current, 1)
    fold.add(big, 1000.0)
    fold.add(small, 1.0)
    step = fold.result(current)["w"] - current["w"]
    expected = (torch.tensor([30.0, -40.0, 0.0]) * (2.0 / 50) + torch.tensor([0.3, 0.0, -0.4])) / 4
    assert torch.allclose(step, expected, atol=1e-6)
    assert fold.metrics() == {"dp_clients": 2, "dp_clip": 2.0, "dp_clipped_fraction": 0.5}


def test_noise_has_the_stated_scale_and_is_the_same_for_the_same_seed_and_round():
    dp = CentralDP(clip=0.5, noise_multiplier=1.5, clients_per_round=10, seed=3)
    like = {"a": torch.zeros(400_000), "b": torch.zeros(100, 1000)}
    n = dp.noise(like, rnd=7)
    draws = torch.cat([n["a"], n["b"].flatten()])
    assert abs(float(draws.std()) / (1.5 * 0.5) - 1) < 0.01 and abs(float(draws.mean())) < 0.005
    assert all(torch.equal(n[k], dp.noise(like, rnd=7)[k]) for k in like)
    assert not torch.equal(n["a"], dp.noise(like, rnd=8)["a"])
    assert not torch.equal(n["a"], CentralDP(0.5, 1.5, 10, seed=4).noise(like, rnd=7)["a"])
    # through the fold: with every client dropped the model still moves, by the noise over K
    current = {"w": torch.zeros(200_000)}
    step = rule(clip=0.5, z=1.5, k=10).round(current, 1).result(current)["w"]
    assert abs(float(step.std()) / (1.5 * 0.5 / 10) - 1) < 0.01


def test_the_adaptive_clip_moves_geometrically_toward_the_target_quantile():
    """Andrew et al. 2021's geometric update, without noise (z = 0, sigma_b = 0) so it can be
    computed by hand: every update clipped (b = 0) grows the clip by exp(0.2 * 0.5); every
    update inside it (b = 1) shrinks it by exp(-0.2 * 0.5). The clip is the rule's state (a
    checkpoint keeps it). With noise, the updates' share of z is (z^-2 - (2 sigma_b)^-2)^-1/2."""
    dp = CentralDP(0.1, 0.0, 4, 0, adaptive=True, target_quantile=0.5, clip_lr=0.2, count_stddev=0.0)
    r = ServerRule(load_config().server, {"w"}, privacy=dp)
    current = {"w": torch.zeros(3)}
    fold = r.round(current, 1)
    for _ in range(4):
        fold.add({"w": torch.tensor([1.0, 0.0, 0.0])}, 1.0)  # norm 1 > 0.1
    fold.result(current)
    assert fold.metrics()["dp_clip"] == 0.1 and dp.clip_norm == pytest.approx(0.1 * math.exp(0.1), rel=1e-12)
    fold = r.round(current, 2)
    for _ in range(4):
        fold.add({"w": torch.tensor([0.01, 0.0, 0.0])}, 1.0)
    fold.result(current)
    assert dp.clip_norm == pytest.approx(0.1, rel=1e-12)
    saved = r.state_dict()["dp_clip"]
    other = CentralDP(0.7, 0.0, 4, 0, adaptive=True)
    ServerRule(load_config().server, {"w"}, privacy=other).load_state_dict({"dp_clip": saved})
    assert other.clip_norm == pytest.approx(0.1, rel=1e-12)
    noisy = CentralDP(1.0, 1.0, 100, 0, adaptive=True)  # sigma_b = 100 / 20 = 5
    assert noisy.update_noise_multiplier == pytest.approx((1.0 - 1 / 100) ** -0.5)
    with pytest.raises(ConfigError, match="privacy.clip_count_stddev=0.5"):
        CentralDP(1.0, 2.0, 10, 0, adaptive=True)  # sigma_b = 0.5: 2 sigma_b <= z


def test_the_accountant_gives_the_librarys_reference_value():
    """dp-accounting's own test (rdp_privacy_accountant_test.test_compute_epsilon_delta_gaussian):
    the Gaussian mechanism with noise multiplier 4.530877117, no sampling, is exactly
    (1, 1e-6)-DP. Here: every client in the one round (K = N). Our accountant uses the
    library's default RDP orders, coarser than that test's. The run's per-round epsilon (one
    round's RDP curve, scaled) is the library's composition of r rounds."""
    from raysim.privacy.accountant import Accountant, epsilon, noise_for_epsilon

    eps = epsilon(4.530877117, num_clients=50, clients_per_round=50, rounds=1, delta=1e-6)
    assert eps == pytest.approx(1.0, abs=1e-5)
    run = Accountant(load_config(overrides=["privacy.mode=central", "privacy.noise_multiplier=1.0", "num_clients=1000",
                                            "clients_per_round=10", "rounds=100"]))
    assert run.delta == pytest.approx(1000 ** -1.1)
    for r in (1, 7, 100):
        assert run.epsilon(r) == pytest.approx(epsilon(1.0, 1000, 10, r, run.delta), rel=1e-12)
    # sampling 10 of 1,000 clients a round costs far less per round than taking everyone
    assert epsilon(1.0, 1000, 10, 100, 1e-5) < epsilon(1.0, 1000, 1000, 100, 1e-5) / 10
    z = noise_for_epsilon(2.0, 1000, 10, 100, 1e-5)
    assert 1.9 < epsilon(z, 1000, 10, 100, 1e-5) <= 2.0 + 1e-6
    assert epsilon(z * 0.9, 1000, 10, 100, 1e-5) > 2.0
    assert epsilon(0.0, 1000, 10, 100, 1e-5) == math.inf


def test_private_runs_are_bit_identical_across_packing_and_report_epsilon(ray_local, tmp_path):
    """One actor with target_epsilon=8 (the server chooses the noise multiplier), then three
    actors given that multiplier directly: the same model, bit for bit; epsilon per round
    grows to the summary's, at most the target."""
    import json

    import pyarrow.parquet as pq

    common = ["dataset=digits", "model=mlp", "num_clients=12", "clients_per_round=6", "rounds=3",
              "privacy.mode=central", "privacy.clip=0.5", "algorithm=fedprox", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "privacy.target_epsilon=8", "resources.num_actors=1", "run_name=a1"]) == 0
    summary = json.loads((tmp_path / "a1" / "summary.json").read_text())
    assert 7.5 < summary["dp_epsilon"] <= 8.0 + 1e-6 and summary["dp_noise_multiplier"] > 0
    assert summary["dp_delta"] == pytest.approx(12 ** -1.1)
    rows = pq.read_table(tmp_path / "a1" / "metrics.parquet").to_pylist()
    eps = [r["epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(summary["dp_epsilon"])
    assert all(0 <= r["dp_clipped_fraction"] <= 1 for r in rows)
    z = summary["dp_noise_multiplier"]
    assert main([*common, f"privacy.noise_multiplier={z}", "resources.num_actors=3", "run_name=a3"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("a1", "a3"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("overrides, message", [
    (["privacy.mode=central", "algorithm=scaffold"], "does not fold its clients' updates through raysim's server"),
    (["privacy.mode=central", "algorithm=ccvr"], "feature"),
    (["privacy.mode=central", "server.aggregator=median"], "needs server.aggregator=mean"),
    (["privacy.mode=central", "selection=fedentopt"], "the accountant assumes the random selection"),
    (["privacy.mode=central", "privacy.clip=0"], "privacy.clip must be > 0"),
    (["privacy.mode=shuffle"], "privacy.mode must be none, central or local"),
    (["privacy.mode=local", "algorithm=fedprox"], "algorithms it covers: .*fedavg.*fedlc"),
    (["privacy.mode=local", "local.vectorize=true"], "set local.vectorize=false"),
    (["privacy.mode=local", "privacy.adaptive_clip=true"], "privacy.adaptive_clip is central's"),
    (["privacy.mode=local", "selection=fedentopt"], "reads the clients' data .*outside DP-SGD"),
    (["privacy.secure_aggregation=secagg", "algorithm=ccvr"], "needs more than the sum of its clients' models"),
    (["privacy.secure_aggregation=secagg", "server.aggregator=median"], "server.aggregator must be mean"),
    (["privacy.secure_aggregation=secagg", "privacy.mode=central"], "central DP clips each update on the server"),
    (["privacy.secure_aggregation=sec"], "must be none, secagg or secagg_plus"),
])
def test_what_cannot_be_private_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_a_model_with_batchnorm_statistics_is_refused_before_anything_is_written(ray_local, tmp_path, capsys):
    code = main(["privacy.mode=central", "privacy.noise_multiplier=1", "model=vgg9", "model_options.norm=batch",
                 "num_clients=4", "rounds=1", f"output_dir={tmp_path / 'runs'}", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "BatchNorm statistics), which would be averaged without" in err, err
    assert not (tmp_path / "runs").exists()


def test_an_adaptive_clip_resumes_bit_for_bit(ray_local, tmp_path):
    common = ["dataset=digits", "model=mclr", "num_clients=12", "clients_per_round=6", "privacy.mode=central",
              "privacy.clip=0.05", "privacy.noise_multiplier=0.5", "privacy.adaptive_clip=true", "checkpoint_every=2",
              f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=2", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=4", "--quiet"]) == 0
    assert main([*common, "rounds=4", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("part", "whole"))
    assert all(torch.equal(a["global"][k], b["global"][k]) for k in b["global"]) and torch.equal(a["dp_clip"], b["dp_clip"])
    import pyarrow.parquet as pq

    clips = [r["dp_clip"] for r in pq.read_table(tmp_path / "whole" / "metrics.parquet").to_pylist()]
    assert clips[0] == 0.05 and len(set(clips)) == 4  # the clip moved every round



def _per_sample_step(model, x, y, lr, clip):
    """DP-SGD's noise-free step by hand: each sample's gradient on its own, clipped to `clip`,
    averaged over the batch, times -lr."""
    import torch.nn.functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(y)):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
        for t, g in zip(total, grads):
            t += g * min(1.0, clip / (norm + 1e-6))
    return [-lr * t / len(y) for t in total]


@pytest.mark.parametrize("model_name, shape", [("mlp", (1, 8, 8)), ("cnn", (1, 28, 28))])
def test_local_dp_sgd_clips_each_samples_gradient_and_adds_the_stated_noise(model_name, shape):
    """Opacus' path on the mlp and the cnn: one step on a batch of all n <= batch_size samples
    (q = 1), no momentum. Without noise the step is -lr times the mean of the per-sample
    gradients each clipped to `clip` (computed here one sample at a time); with noise z the
    difference from that step is Gaussian with standard deviation lr * z * clip / n, the same
    draw for the same (seed, round, client) and another for another client."""
    pytest.importorskip("opacus")
    from raysim.contract import Client
    from raysim.models import build_model
    from raysim.training import local_sgd

    n, lr, clip = 16, 0.5, 0.01
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)

    def step(z, cid=3):
        cfg = load_config(overrides=["privacy.mode=local", f"privacy.clip={clip}", f"privacy.noise_multiplier={z}",
                                     f"local.lr={lr}", "local.momentum=0", "local.weight_decay=0", "local.steps=1",
                                     f"local.batch_size={n}"])
        torch.manual_seed(1)
        model = build_model(model_name, shape, 10)
        start = [p.detach().clone() for p in model.parameters()]
        client = Client(cid, 1, cfg, x, y, 10, torch.device("cpu"), torch.Generator().manual_seed(5), {}, model)
        stats = local_sgd(client, model)
        assert stats["steps"] == 1 and not any(hasattr(p, "grad_sample") for p in model.parameters())
        assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())  # hooks removed
        return [p.detach() - s for p, s in zip(model.parameters(), start)], start

    clean, start = step(0.0)
    torch.manual_seed(1)
    model = build_model(model_name, shape, 10)
    expected = _per_sample_step(model, x, y, lr, clip)
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-4) for a, b in zip(clean, expected))
    assert float(torch.sqrt(sum((d ** 2).sum() for d in clean))) <= lr * clip + 1e-6  # each sample moves it <= lr C / n
    noisy, _ = step(2.0)
    diff = torch.cat([(a - b).flatten() for a, b in zip(noisy, clean)])
    assert len(diff) > 2000 and abs(float(diff.std()) / (lr * 2.0 * clip / n) - 1) < 0.08
    again, _ = step(2.0)
    assert all(torch.equal(a, b) for a, b in zip(noisy, again))
    other, _ = step(2.0, cid=4)
    assert not torch.equal(noisy[0], other[0])


def test_the_local_accountant_composes_each_clients_steps():
    """Client i's epsilon is dp-accounting's for its steps of Poisson-sampled Gaussian at
    q_i = batch_size / n_i (integer orders, a little looser than the default ones); the run
    reports the largest; target_epsilon chooses z so that the smallest client in every round
    spends at most it."""
    import dp_accounting

    from raysim.privacy.accountant import LocalAccountant

    cfg = load_config(overrides=["privacy.mode=local", "privacy.noise_multiplier=1.1", "local.batch_size=10",
                                 "local.epochs=1", "rounds=10", "privacy.delta=1e-5"])
    acc = LocalAccountant(cfg, [1000, 100, 40])
    reference = dp_accounting.rdp.RdpAccountant()
    reference.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1)), 1000)
    assert acc.client_epsilon(0, 1000) == pytest.approx(reference.get_epsilon(1e-5), rel=0.03)
    assert acc.client_epsilon(0, 1000) >= reference.get_epsilon(1e-5) - 1e-9
    rows = [{"cid": c, "method": "client_update", "status": s, "epochs": 1} for c, s in ((0, "ok"), (2, "dropped"))]
    spent = acc.after_round(1, rows)
    assert acc.steps.tolist() == [100, 0, 0] and spent == acc.client_epsilon(0, 100)
    assert acc.after_round(2, [{"cid": 2, "method": "client_update", "status": "ok", "epochs": 2}]) == max(
        spent, acc.client_epsilon(2, 8))  # 2 epochs of ceil(40 / 10) steps
    target = LocalAccountant(load_config(overrides=["privacy.mode=local", "privacy.target_epsilon=3", "local.batch_size=10",
                                                    "local.epochs=1", "rounds=10", "privacy.delta=1e-5"]), [1000, 100, 40])
    z = target.noise_multiplier
    assert max(target.client_epsilon(c, int(target.per_round[c]) * 10) for c in range(3)) <= 3 + 1e-3
    assert target.client_epsilon(2, 40, noise_multiplier=z * 0.95) > 3


def test_local_dp_runs_are_bit_identical_across_packing_and_resume(ray_local, tmp_path):
    """Local DP-SGD end to end: one actor, stopped after round 2 and resumed, against two
    actors in one go: the same model and the same epsilon per round, bit for bit."""
    pytest.importorskip("opacus")
    import json

    import pyarrow.parquet as pq

    common = ["dataset=digits", "model=mlp", "num_clients=8", "clients_per_round=4", "privacy.mode=local",
              "privacy.clip=1.0", "privacy.noise_multiplier=0.8", "algorithm=fedlc", "checkpoint_every=1",
              f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "rounds=2", "resources.num_actors=1", "run_name=part"]) == 0
    assert main([f"resume={tmp_path / 'part'}", "rounds=3", "--quiet"]) == 0
    assert main([*common, "rounds=3", "resources.num_actors=2", "run_name=whole"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("part", "whole"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    eps = [[r["epsilon"] for r in pq.read_table(tmp_path / n / "metrics.parquet").to_pylist()] for n in ("part", "whole")]
    assert eps[0] == eps[1] and eps[1] == sorted(eps[1]) and eps[1][0] > 0
    assert json.loads((tmp_path / "whole" / "summary.json").read_text())["dp_epsilon"] == eps[1][-1]


# ---------------------------------------------------------------- secure aggregation, simulated
def test_secure_aggregation_costs_and_failures_by_hand():
    """SecAgg on a cohort of 5 (complete graph, k = 4) with m = 100 entries of 32 bits: a
    survivor uploads 2 keys (64 B) + 4 sealed share pairs (4 * 88 B) + the masked update
    (400 B) + 4 unmasking shares (128 B) = 944 B and downloads 4 * 64 + 4 * 88 + 4 * 5 = 628 B.
    One dropout: the server expands 4 self masks + the dropped client's 4 pairwise masks;
    three dropouts leave each survivor one surviving neighbour, fewer than t = 2: failed.
    SecAgg+'s Harary graph: k neighbours each, symmetric, drawn from (seed, round)."""
    from raysim.privacy.secagg import SecureAggregation

    sa = SecureAggregation("secagg", bits=32, threshold=0.5, neighbours=None, seed=0)
    cohort = [3, 5, 8, 13, 21]
    assert sa.account(1, cohort, set(cohort), m=100) is False
    assert sa.metrics["secagg_bytes_up_per_client"] == 944 and sa.metrics["secagg_bytes_down_per_client"] == 628
    assert sa.metrics["secagg_upload_vs_plain"] == 944 / 400 and sa.metrics["secagg_prg_expansions"] == 5
    assert sa.account(1, cohort, {3, 5, 8, 13}, m=100) is False and sa.metrics["secagg_prg_expansions"] == 4 + 4
    assert sa.account(1, cohort, {3, 5}, m=100) is True and sa.metrics["secagg_failed"] == 1
    plus = SecureAggregation("secagg_plus", bits=16, threshold=0.5, neighbours=None, seed=0)
    n = 200
    graph = plus.neighbours(7, n)
    k = plus.degree(n)
    assert k == 8 and all(len(g) == k for g in graph)
    assert all(i in graph[j] for i in range(n) for j in graph[i])  # symmetric
    assert all((a == b).all() for a, b in zip(graph, plus.neighbours(7, n)))
    assert any((a != b).any() for a, b in zip(graph, plus.neighbours(8, n)))
    plus.account(7, list(range(n)), set(range(n)), m=10_000)
    full = SecureAggregation("secagg", 16, 0.5, None, 0)
    full.account(7, list(range(n)), set(range(n)), m=10_000)
    assert plus.metrics["secagg_bytes_up_per_client"] < full.metrics["secagg_bytes_up_per_client"] / 2  # O(log n) vs O(n)


def test_secure_aggregation_gives_fedavg_the_sum_only_and_the_same_model(ray_local, tmp_path):
    """With secure aggregation the algorithm gets one summed result a round; FedAvg's model is
    bit for bit the one without it (same dropouts), and each round records the protocol's
    bytes and survivors; the clients table still has each client's row."""
    import pyarrow.parquet as pq

    common = ["dataset=digits", "model=mclr", "num_clients=12", "clients_per_round=8", "rounds=2", "system.dropout=0.25",
              "seed=2", "privacy.secagg_threshold=0.2", f"output_dir={tmp_path}", "--quiet"]
    assert main([*common, "privacy.secure_aggregation=secagg_plus", "run_name=sa"]) == 0
    assert main([*common, "run_name=plain"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["global"] for n in ("sa", "plain"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = pq.read_table(tmp_path / "sa" / "metrics.parquet").to_pylist()
    assert all(r["secagg_failed"] == 0 and r["secagg_survivors"] == 8 - r["dropped"] for r in rows)
    assert sum(r["dropped"] for r in rows) > 0
    assert all(r["secagg_bytes_up_per_client"] > 4 * 650 for r in rows)  # mclr on digits: 64 * 10 + 10 entries
    clients = pq.read_table(tmp_path / "sa" / "clients.parquet").to_pylist()
    assert sum(c["status"] == "ok" for c in clients) == sum(r["secagg_survivors"] for r in rows)


def test_a_sweep_point_with_target_epsilon_counts_as_the_same_config_when_rerun():
    """The run records the noise multiplier target_epsilon chose; the point's config asks for
    the target again (noise 0): the same point, not another config. Another target is."""
    from raysim.config import record_diff, run_record

    asked = ["privacy.mode=central", "privacy.target_epsilon=8"]
    ran = run_record(load_config(overrides=[*asked, "privacy.noise_multiplier=0.83"]))
    assert record_diff(ran, load_config(overrides=asked)) == []
    assert record_diff(ran, load_config(overrides=["privacy.mode=central", "privacy.target_epsilon=2"])) == [
        "privacy.target_epsilon"]
    assert record_diff(ran, load_config(overrides=["privacy.mode=central", "privacy.noise_multiplier=0.5"])) == [
        "privacy.noise_multiplier", "privacy.target_epsilon"]
