"""Privacy of the clients' data, as platform parts any algorithm can take (`privacy.*`):

- `central.CentralDP`: DP-FedAvg's server side (user-level DP; McMahan et al. 2018): each
  client's update clipped in L2 (a fixed clip, or one that follows a quantile of the norms:
  Andrew et al. 2021), Gaussian noise on their sum, the sum divided by the fixed cohort
  size, then the server's optimiser (post-processing); for algorithms with "privacy" in
  `Algorithm.server_parts`;
- `raysim/dp_sgd.py`'s `private_sgd` (`privacy.mode=local`): DP-SGD in each client's training
  through Opacus (sample-level DP; Abadi et al. 2016), for algorithms with
  `Algorithm.trains_privately`; it lives beside `training`, which hands a client to it;
- `secagg.SecureAggregation`: secure aggregation simulated: the server reads only the
  round's sum, and the protocol's bytes and dropout failures are recorded;
- `accountant`: the (epsilon, delta) a run spends, from Google's dp-accounting (RDP), for
  raysim's sampling: a fixed number of clients drawn uniformly without replacement each
  round (central), Poisson-sampled batches per client (local); `privacy.target_epsilon`
  chooses the noise multiplier.

What is guaranteed, and what is not, is in docs/guide.md, "Privacy".
"""
