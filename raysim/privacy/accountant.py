"""The privacy a run spends, from Google's dp-accounting (the `privacy` extra), not a
hand-written formula.

A round of `privacy.mode=central` is a Gaussian mechanism of noise multiplier z on the sum
of the clipped updates of K clients drawn uniformly without replacement from N: in
dp-accounting's terms `SampledWithoutReplacementDpEvent(N, K, GaussianDpEvent(z))` (K = N:
`GaussianDpEvent(z)` alone), composed over the rounds. It is analysed with the RDP
accountant under the replace-one neighbouring relation, the one its analysis of sampling
without replacement supports (Wang, Balle, Kasiviswanathan 2019): two populations differ in
one client's data (user-level DP). delta defaults to 1 / N^1.1 (below 1 / N, the usual rule).
`noise_for_epsilon` inverts it with dp-accounting's `calibrate_dp_mechanism`.
"""
from __future__ import annotations

import math


def default_delta(num_clients: int) -> float:
    return 1.0 / float(num_clients) ** 1.1


def round_event(noise_multiplier: float, num_clients: int, clients_per_round: int):
    import dp_accounting

    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    if clients_per_round >= num_clients:
        return gaussian
    return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, clients_per_round, gaussian)


def _accountant():
    import dp_accounting

    return dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)


def epsilon(noise_multiplier: float, num_clients: int, clients_per_round: int, rounds: int, delta: float) -> float:
    """The epsilon that `rounds` rounds spend at `delta` (inf without noise)."""
    if noise_multiplier <= 0:
        return math.inf
    acc = _accountant()
    acc.compose(round_event(noise_multiplier, num_clients, clients_per_round), rounds)
    return float(acc.get_epsilon(delta))


def noise_for_epsilon(target_epsilon: float, num_clients: int, clients_per_round: int, rounds: int,
                      delta: float) -> float:
    """The smallest noise multiplier for which `rounds` rounds spend at most `target_epsilon`."""
    import dp_accounting

    def event(z: float):
        return dp_accounting.SelfComposedDpEvent(round_event(z, num_clients, clients_per_round), rounds)

    return float(dp_accounting.calibrate_dp_mechanism(_accountant, event, target_epsilon, delta,
                                                      dp_accounting.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-4))


class Accountant:
    """The run's accounting: the noise multiplier (chosen for `privacy.target_epsilon` when
    set) and the epsilon spent after each round."""

    def __init__(self, cfg, resumed: bool = False):
        """`resumed`: a resumed run keeps the noise multiplier its config.yaml saved (chosen
        for the rounds asked then), whatever `rounds` is now."""
        from raysim.config import clients_per_round

        pv = cfg.privacy
        self.n, self.k, self.rounds = int(cfg.num_clients), clients_per_round(cfg), int(cfg.rounds)
        self.clip = float(pv.clip)
        self.delta = float(pv.delta) if pv.delta is not None else default_delta(self.n)
        self.noise_multiplier = (noise_for_epsilon(float(pv.target_epsilon), self.n, self.k, self.rounds, self.delta)
                                 if pv.target_epsilon is not None and not resumed else float(pv.noise_multiplier))

    def epsilon(self, rounds_done: int) -> float:
        """The epsilon after `rounds_done` rounds. RDP composes by adding: the one round's RDP
        curve is computed once (0.3 s for sampling without replacement) and scaled, instead
        of the library composing r rounds anew every round; the library's own `compute_epsilon`
        turns it into epsilon (the test checks it against `epsilon()` above)."""
        if self.noise_multiplier <= 0:
            return math.inf
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        if getattr(self, "_curve", None) is None:
            acc = _accountant()
            acc.compose(round_event(self.noise_multiplier, self.n, self.k))
            self._curve = (acc._orders, acc._rdp)  # the accountant's RDP orders and curve after one round
        orders, rdp = self._curve
        return float(compute_epsilon(orders, rdp * rounds_done, self.delta)[0])

    def describe(self) -> str:
        return (f"privacy: DP-FedAvg, clip {self.clip:g}, noise multiplier {self.noise_multiplier:.4g}, {self.k} of "
                f"{self.n} clients a round drawn without replacement; {self.rounds} rounds spend epsilon "
                f"{self.epsilon(self.rounds):.4g} at delta {self.delta:.3g} (RDP, dp-accounting)")
