"""Prompt-lookup drafting against a brute-force search."""

from __future__ import annotations

import random

import pytest

from loraserve.runtime.speculative.ngram.index import NgramIndex, propose_ngram


def _brute_force(tokens: list[int], num: int, nmin: int, nmax: int) -> tuple[list[int], int]:
    """Scan every earlier position for the longest suffix n-gram; latest occurrence wins."""
    length = len(tokens)
    for n in range(min(nmax, length - 1), nmin - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                ext = list(tokens)
                for j in range(num):
                    ext.append(ext[start + n + j])
                return ext[length:], n
    return [tokens[-1]] * num, 0


@pytest.mark.parametrize("nmin,nmax", [(1, 4), (2, 3), (1, 1), (3, 5)])
def test_incremental_index_matches_brute_force(nmin, nmax):
    rng = random.Random(nmin * 10 + nmax)
    for trial in range(60):
        vocab = rng.choice([3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        index = NgramIndex(nmin, nmax)
        for i, token in enumerate(tokens):
            index.append(token)
            num = rng.randrange(1, 6)
            assert index.propose(num) == _brute_force(tokens[: i + 1], num, nmin, nmax), (trial, i)


def test_repeating_text_is_continued_and_wraps():
    tokens = [7, 1, 2, 3, 1, 2, 3, 1, 2]
    proposal, n = propose_ngram(tokens, 5, 1, 4)
    assert n == 4  # "2 3 1 2" occurred at position 2
    assert proposal == [3, 1, 2, 3, 1]


def test_longest_ngram_wins():
    """Longest n-gram wins over a later shorter one."""
    # "1 2" last occurs at 5 (followed by 9); the full "0 1 2" only at 0 (followed by 4).
    tokens = [0, 1, 2, 4, 5, 1, 2, 9, 0, 1, 2]
    assert propose_ngram(tokens, 1, 1, 3) == ([4], 3)
    assert propose_ngram(tokens, 1, 1, 2) == ([9], 2)


def test_no_match_repeats_the_last_token():
    assert propose_ngram([1, 2, 3], 3, 1, 4) == ([3, 3, 3], 0)
    assert propose_ngram([5], 2, 1, 4) == ([5, 5], 0)


def test_bad_bounds_name_the_field():
    with pytest.raises(ValueError, match="ngram_min"):
        NgramIndex(0, 3)
    with pytest.raises(ValueError, match="ngram_max"):
        NgramIndex(4, 2)
    with pytest.raises(ValueError, match="empty"):
        NgramIndex(1, 2).propose(3)
