"""Shared helpers for the speculative-decoding tests."""

from __future__ import annotations

import pytest
import torch


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; returns the p-value.

    Cells with expected count below 5 are pooled into one, as the test requires.
    """
    observed = observed.double().flatten()
    probs = expected_probs.double().flatten()
    probs = probs / probs.sum()
    n = observed.sum()
    expected = probs * n
    small = expected < 5
    if bool(small.any()):
        obs = torch.cat([observed[~small], observed[small].sum()[None]])
        exp = torch.cat([expected[~small], expected[small].sum()[None]])
    else:
        obs, exp = observed, expected
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):
        return 0.0  # something landed where the target puts no mass
    obs, exp = obs[keep], exp[keep]
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


@pytest.fixture
def chi_square():
    """``chi_square(observed_counts, expected_probs) -> p-value``."""
    return chi_square_pvalue
