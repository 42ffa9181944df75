"""Prompt-lookup (n-gram) drafting: propose what followed the last n-gram earlier on.

For a request's tokens (prompt + generated), find the most recent earlier occurrence of
its last ``n`` tokens, trying ``n`` from ``ngram_max`` down to ``ngram_min``, and propose
the tokens that followed it. A continuation that runs into the end of the sequence wraps
onto the proposal itself (a repeating pattern keeps repeating). No model runs, so the
proposals are deterministic: acceptance treats their distribution as one-hot.

The index is incremental: appending a token updates ``ngram_max - ngram_min + 1``
entries, and a lookup is ``O(ngram_max)``, independent of the sequence length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class NgramIndex:
    """Latest start position of every n-gram (``ngram_min <= n <= ngram_max``) that has a successor."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, tokens: Iterable[int] = ()) -> None:
        if ngram_min < 1:
            raise ValueError(f"speculative.ngram_min must be >= 1, got {ngram_min}")
        if ngram_max < ngram_min:
            raise ValueError(
                f"speculative.ngram_max ({ngram_max}) must be >= speculative.ngram_min ({ngram_min})"
            )
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.tokens: list[int] = []
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """Add one committed token; the n-grams ending just before it gain a successor."""
        self.tokens.append(int(token))
        end = len(self.tokens) - 1  # the n-grams ending at `end` (exclusive) now have a successor
        for n, table in self._latest.items():
            start = end - n
            if start < 0:
                break
            table[tuple(self.tokens[start:end])] = start

    def extend(self, tokens: Iterable[int]) -> None:
        """Add several committed tokens in order."""
        for token in tokens:
            self.append(token)

    def match(self) -> tuple[int, int]:
        """``(n, start)`` of the longest suffix n-gram seen before, or ``(0, -1)`` when none."""
        length = len(self.tokens)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            start = self._latest[n].get(tuple(self.tokens[length - n :]))
            if start is not None:
                return n, start
        return 0, -1

    def propose(self, num_tokens: int) -> tuple[list[int], int]:
        """``num_tokens`` proposals and the n-gram length that matched (0: none matched).

        With no match the last token is repeated: any proposal is lossless, and a
        verify step of fixed width keeps the batch's LoRA segments uniform.
        """
        if num_tokens <= 0:
            return [], 0
        if not self.tokens:
            raise ValueError("cannot draft for an empty sequence")
        n, start = self.match()
        if n == 0:
            return [self.tokens[-1]] * num_tokens, 0
        seq = self.tokens
        length = len(seq)
        out: list[int] = []
        pos = start + n
        for _ in range(num_tokens):
            out.append(seq[pos] if pos < length else out[pos - length])
            pos += 1
        return out, n


def propose_ngram(
    tokens: Sequence[int], num_tokens: int, ngram_min: int = 1, ngram_max: int = 4
) -> tuple[list[int], int]:
    """One-shot prompt lookup over ``tokens`` (builds a throwaway index)."""
    return NgramIndex(ngram_min, ngram_max, tokens).propose(num_tokens)
