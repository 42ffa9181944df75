"""``loraserve-token-map``: an FR-Spec token map from a corpus, read back by the runtime."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from loraserve.runtime.speculative.draft_vocab import load_token_map
from loraserve.runtime.tokenizer import Tokenizer
from loraserve.runtime.tools.token_map import choose_token_map, count_tokens, coverage, main


def test_choice_keeps_specials_first():
    """Choice keeps specials then the most frequent with ties by ID."""
    counts = Counter({7: 5, 3: 9, 11: 5, 2: 1, 99: 50})
    assert choose_token_map(counts, 4, vocab_size=20, keep=[2, 0]) == [2, 0, 3, 7]
    assert choose_token_map(counts, 10, vocab_size=20) == [3, 7, 11, 2]  # 99 is past the vocabulary
    with pytest.raises(ValueError, match="at least one"):
        choose_token_map(counts, 0, vocab_size=20)
    assert coverage(counts, [3, 99]) == pytest.approx(59 / 70)
    assert count_tokens(lambda s: [len(w) for w in s.split()], ["a bb a", "ccc"]) == Counter(
        {1: 2, 2: 1, 3: 1}
    )


def test_command_writes_readable_map(spec_assets, tmp_path, capsys):
    """The command writes a map the runtime reads."""
    tokenizer = Tokenizer.load(spec_assets.target)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    common = "def add(a, b):\n    return a + b\n" * 40
    (corpus / "a.py").write_text(common)
    (corpus / "b.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 3)
    out = tmp_path / "maps" / "freq.json"
    assert main([str(corpus), "--model", str(spec_assets.target), "--size", "24", "--out", str(out)]) == 0
    ids = json.loads(out.read_text())
    vocab = json.loads((spec_assets.target / "config.json").read_text())["vocab_size"]
    assert load_token_map(out, vocab).tolist() == ids and len(ids) <= 24
    assert tokenizer.eos_token_ids <= set(ids)  # a draft must be able to propose the end
    counts = count_tokens(
        lambda t: tokenizer.encode(t, add_special_tokens=False), [common, (corpus / "b.txt").read_text()]
    )
    assert len(counts) > 24  # the corpus has more tokens than the map holds
    counted = [t for t in ids if t in counts and t not in tokenizer.eos_token_ids]
    left_out = [t for t in counts if t not in ids]
    assert left_out and min(counts[t] for t in counted) >= max(counts[t] for t in left_out)
    printed = capsys.readouterr().out
    assert f"{len(ids)} of {tokenizer.vocab_size} tokens" in printed
    assert f"{coverage(counts, ids):.2%}" in printed
    assert torch.tensor(ids).unique().numel() == len(ids)


def test_missing_corpus_is_named(spec_assets, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        main(
            [str(tmp_path / "nowhere"), "--model", str(spec_assets.target), "--out", str(tmp_path / "m.json")]
        )
