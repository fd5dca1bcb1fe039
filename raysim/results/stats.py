"""The two tests the results documents decide by (scipy.stats), at LEVEL two-sided:

- `paired_p`: a method against its baseline in the same setting, paired over seeds (a seed
  is the same partition and initial model for both), Student's t on the differences
  (`ttest_rel`); the claims' verdicts (published.py, issue 84);
- `welch_p`: raysim's cell against a published mean and std (another lab's runs: nothing
  to pair), Welch's unequal-variance t (`ttest_ind_from_stats`); beside.py (issue 83)."""
from __future__ import annotations

LEVEL = 0.05


def paired_p(mine: list[float], base: list[float]) -> float | None:
    """Two-sided p of a paired t-test, mine[i] against base[i] (the same seed); None with
    fewer than 2 pairs. Differences all equal: 1 if they are 0, else 0 (no spread to weigh)."""
    from scipy.stats import ttest_rel

    if len(mine) != len(base):
        raise ValueError(f"paired samples of different sizes: {len(mine)} and {len(base)}")
    if len(mine) < 2:
        return None
    diffs = [a - b for a, b in zip(mine, base)]
    if max(diffs) - min(diffs) <= 1e-12 * max(1.0, max(abs(d) for d in diffs)):
        return 1.0 if abs(diffs[0]) <= 1e-12 else 0.0
    return float(ttest_rel(mine, base).pvalue)


def welch_p(m1: float, s1: float, n1: int, m2: float, s2: float, n2: int) -> float:
    """Welch's two-sided p-value for equal means from two samples' means, standard
    deviations (n-1) and sizes; with no spread on either side: 1 if the means are equal, else 0."""
    from scipy.stats import ttest_ind_from_stats

    if s1 == 0 and s2 == 0:
        return 1.0 if m1 == m2 else 0.0
    return float(ttest_ind_from_stats(m1, s1, n1, m2, s2, n2, equal_var=False).pvalue)
