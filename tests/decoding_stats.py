"""Goodness-of-fit helper shared by the decoding losslessness tests.

Pearson's chi-square test of observed token-sequence counts against the exact target
distribution. Cells with expected count < 5 are pooled into one cell (the usual validity rule);
a sample in a cell of probability zero (a token top-k/top-p forbids) is an immediate failure.
"""

from __future__ import annotations

import torch
from scipy.stats import chi2

FALSE_ALARM_RATE = 1e-3
"""A correct sampler fails one run in a thousand (each test runs at a fixed seed, so it is
deterministic; the rate says how unlucky a seed would have to be)."""


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``counts`` (any shape) being a multinomial draw from ``probs`` (same shape)."""
    counts = counts.reshape(-1).double()
    probs = probs.reshape(-1).double()
    total = counts.sum()
    if bool((counts[probs <= 1e-12] > 0).any()):
        return 0.0
    expected = probs * total
    big = expected >= 5
    observed_cells = torch.cat([counts[big], counts[~big & (probs > 1e-12)].sum().reshape(1)])
    expected_cells = torch.cat([expected[big], expected[~big & (probs > 1e-12)].sum().reshape(1)])
    if float(expected_cells[-1]) == 0.0:
        observed_cells, expected_cells = observed_cells[:-1], expected_cells[:-1]
    statistic = float(((observed_cells - expected_cells) ** 2 / expected_cells).sum())
    return float(chi2.sf(statistic, df=len(expected_cells) - 1))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """TV distance between the empirical distribution of ``counts`` and ``probs``."""
    empirical = counts.reshape(-1).double() / counts.sum()
    return 0.5 * float((empirical - probs.reshape(-1).double()).abs().sum())
