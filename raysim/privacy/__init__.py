"""Differential privacy of the clients' updates, as platform parts any algorithm that folds
its clients' models through raysim's server parts (`Algorithm.server_parts` holds
"privacy": FedAvg and the client-side methods built on it) takes with `privacy.*`:

- `central.CentralDP`: DP-FedAvg's server side (user-level DP; McMahan et al. 2018): each
  client's update clipped in L2 (a fixed clip, or one that follows a quantile of the norms:
  Andrew et al. 2021), Gaussian noise on their sum, the sum divided by the fixed cohort
  size, then the server's optimiser (post-processing);
- `accountant`: the (epsilon, delta) a run spends, from Google's dp-accounting (RDP), for
  raysim's sampling: a fixed number of clients drawn uniformly without replacement each
  round; `privacy.target_epsilon` chooses the noise multiplier.

What is guaranteed, and what is not, is in docs/guide.md, "Privacy".
"""
