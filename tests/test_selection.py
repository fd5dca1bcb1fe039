"""Selection strategies against ALGORITHMS.md (FedEntOpt, KL), on hand-made count tables."""
import itertools

import numpy as np
import pytest
import torch

from raysim.algorithms.fedentopt import FedEntOpt, KLSelection, greedy_max_entropy, noisy_counts
from raysim.contract import Client
from raysim.config import ConfigError, load_config
from raysim.data.partition import label_entropy

# 6 clients, 3 labels
COUNTS = np.array([
    [10, 0, 0],   # 0
    [0, 10, 0],   # 1
    [10, 0, 0],   # 2
    [0, 0, 10],   # 3
    [5, 5, 0],    # 4
    [0, 2, 8],    # 5
], dtype=float)


def strategy(n=6, buffer=0.5, counts=COUNTS, **kw):
    over = [f"num_clients={n}", f"fedentopt.buffer={buffer}", "selection=fedentopt"] + [f"{k}={v}" for k, v in kw.items()]
    s = FedEntOpt(load_config(overrides=over), n, counts.shape[1])
    s.counts = counts.copy()
    return s


def test_entropy_helper():
    assert label_entropy([5, 5]) == pytest.approx(np.log(2))
    assert label_entropy([7, 0, 0]) == 0.0
    assert label_entropy([0, 0]) == 0.0


def test_each_greedy_step_is_the_entropy_maximiser():
    chosen = greedy_max_entropy(COUNTS, list(range(6)), 4, start=[0])
    # from [10,0,0]: +5 -> [10,2,8], H = 0.94 beats +1 or +3 (H = log 2 = 0.69) and +4 (0.64);
    # then +1 -> [10,12,8], H = 1.08 beats +4 -> [15,7,8] (1.04) and +3 -> [10,2,18] (0.83)
    assert chosen[:3] == [0, 5, 1]
    for step in range(1, 4):  # brute force: no other candidate does better at any step
        total = COUNTS[chosen[:step]].sum(0)
        best = max(label_entropy(total + COUNTS[c]) for c in range(6) if c not in chosen[:step])
        assert label_entropy(total + COUNTS[chosen[step]]) == pytest.approx(best)


def test_buffered_clients_are_never_chosen_and_the_buffer_is_fifo():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 20, (20, 5)).astype(float)
    s = strategy(n=20, buffer=0.5, counts=counts)  # B = 10, K = 4: always >= 10 candidates
    history = []
    for rnd in range(1, 30):
        before = set(s.buffer)
        chosen = s.select(rnd, 4, np.random.default_rng([1, rnd]))
        assert len(chosen) == 4 and len(set(chosen)) == 4
        assert not before & set(chosen)
        history.extend(chosen)
        assert list(s.buffer) == history[-10:]  # the last B picks, oldest first


def test_fallback_takes_all_candidates_then_the_oldest_buffered():
    s = strategy(n=6, buffer=0.5)  # B = 3
    s.buffer.extend([4, 1, 5])  # oldest first
    chosen = s.select(1, 4, np.random.default_rng(0))  # candidates 0, 2, 3: fewer than 4
    assert sorted(chosen[:3]) == [0, 2, 3] and chosen[3] == 4
    assert list(s.buffer) == chosen[-3:]  # the newest B picks; 4 moved to the newest end


def test_same_seed_same_cohorts():
    def cohorts(seed):
        s = strategy(n=6, buffer=0.3)
        return [s.select(r, 2, np.random.default_rng([seed, r])) for r in range(1, 8)]

    assert cohorts(0) == cohorts(0)
    assert any(a != b for a, b in zip(cohorts(0), cohorts(5)))


def test_kl_baseline_is_deterministic_and_balanced():
    s = KLSelection(load_config(overrides=["num_clients=6"]), 6, 3)
    s.counts = COUNTS.copy()
    a = s.select(1, 3, np.random.default_rng(1))
    assert a == s.select(2, 3, np.random.default_rng(2))  # no buffer, no randomness: same clients
    assert a[0] == 4  # alone, [5,5,0] is the closest to uniform
    for step in range(1, 3):  # greedy: each step the minimum KL (= maximum entropy) addition
        total = COUNTS[a[:step]].sum(0)
        best = max(label_entropy(total + COUNTS[c]) for c in range(6) if c not in a[:step])
        assert label_entropy(total + COUNTS[a[step]]) == pytest.approx(best)
    # greedy, not exhaustive: {0, 1, 3} would be perfectly balanced
    optimum = max(label_entropy(COUNTS[list(c)].sum(0)) for c in itertools.combinations(range(6), 3))
    assert label_entropy(COUNTS[a].sum(0)) <= optimum


def test_dp_noise_is_laplace_with_scale_one_over_epsilon_and_never_negative():
    rng = np.random.default_rng(0)
    counts = np.full(200_000, 3.0)
    for eps in (0.5, 2.0):
        noisy = noisy_counts(counts, eps, rng)
        assert noisy.min() >= 0
        # before clipping the noise is Laplace(0, b = 1/eps): its median absolute value is b ln 2
        raw = noisy_counts(np.full(200_000, 1e6), eps, rng) - 1e6
        assert np.median(np.abs(raw)) == pytest.approx(np.log(2) / eps, rel=0.03)
        assert np.mean(np.abs(raw)) == pytest.approx(1 / eps, rel=0.03)
    assert np.array_equal(noisy_counts(counts, 0.0, rng), counts)


def test_clients_add_the_noise_themselves():
    cfg = load_config(overrides=["selection=fedentopt", "fedentopt.epsilon=1.0", "num_clients=4"])
    s = FedEntOpt(cfg, 4, 3)
    y = torch.tensor([0, 0, 1, 2, 2, 2])
    def upload(seed):
        c = Client(2, 0, cfg, torch.zeros(6, 1), y, 3, torch.device("cpu"), torch.Generator().manual_seed(seed), {}, None)
        return s.label_counts(c, {"epsilon": 1.0}).update
    a, b = upload(11), upload(11)
    assert np.array_equal(a, b) and (a >= 0).all()  # reproducible from the client's seed
    assert not np.array_equal(a, [2, 1, 3])  # noised on the client
    assert np.array_equal(s.label_counts(Client(2, 0, cfg, torch.zeros(6, 1), y, 3, torch.device("cpu"),
                          torch.Generator().manual_seed(1), {}, None), {"epsilon": 0.0}).update, [2, 1, 3])


def test_bad_fedentopt_settings():
    with pytest.raises(ConfigError, match="fedentopt.buffer"):
        load_config(overrides=["selection=fedentopt", "fedentopt.buffer=1.5"])
    with pytest.raises(ConfigError, match="fedentopt.epsilon"):
        load_config(overrides=["selection=fedentopt", "fedentopt.epsilon=-1"])


def test_uniform_selection_draws_positions_in_O_k_and_picks_what_the_array_draw_picked():
    """`selection=random` draws k positions among the clients there and takes them: the same
    clients as `rng.choice(np.asarray(available), k)` (the draw before issue 73), with late
    joiners absent, without making an array of every client each round."""
    import numpy as np
    from omegaconf import OmegaConf

    from raysim.algorithms.uniform import UniformSelection

    s = UniformSelection(OmegaConf.create({}), 100_000, 10)
    s.available = [c for c in range(100_000) if c % 7]
    for seed, k in ((0, 1), (1, 10), (2, 1000)):
        before = sorted(np.random.default_rng(seed).choice(np.asarray(s.available), k, replace=False).tolist())
        assert s.select(1, k, np.random.default_rng(seed)) == before
    # every client there (a range, issue 73: no list of them): the same draw, and plain ints
    s.available = range(100_000)
    for seed, k in ((0, 1), (3, 1000)):
        before = sorted(np.random.default_rng(seed).choice(100_000, k, replace=False).tolist())
        got = s.select(1, k, np.random.default_rng(seed))
        assert got == before and all(type(c) is int for c in got)
