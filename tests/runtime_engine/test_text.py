"""Tokenizer loading, chat templates, streaming detokenisation and stop strings."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from loraserve.runtime.engine.text import TextStream
from loraserve.runtime.tokenizer import REPLACEMENT_CHAR, ChatMessage, Tokenizer

TEXTS = [
    "plain ascii text with spaces and\nnewlines",
    "héllo wörld — naïve café",
    "日本語のテキストと中文字符",
    "emoji 😀🎉👩‍💻 mixed with code: def f(x): return x**2",
    "Ünïcödé ✓ ∑ ∞ ≠ → ← 🐍 done",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_whole_chars(tokenizer, text):
    """Streamed deltas never split a character and add up."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = tokenizer.detokenizer(tokenizer.encode("prefix: "))
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert detok.text == text
    # Byte-level BPE splits multi-byte characters, so some deltas must have waited.
    if any(ord(ch) > 127 for ch in text):
        assert "" in deltas[:-1]


def test_random_splits_of_valid_text_reassemble(tokenizer):
    rng = random.Random(0)
    alphabet = "abc xyz é漢😀\n"
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = tokenizer.detokenizer([])
        out = "".join(detok.push(i) for i in ids) + detok.flush()
        assert out == text


def _stream(tokenizer, text: str, stops, include=False) -> tuple[list[str], bool, str]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer.detokenizer([]), stops, include)
    pieces, stopped = [], False
    for i in ids:
        delta, hit = stream.push(i)
        pieces.append(delta)
        if hit:
            stopped = True
            break
    if not stopped:
        pieces.append(stream.finish())
    return pieces, stopped, "".join(pieces)


def test_stop_strings_across_tokens_never_leak(tokenizer):
    text = "alpha beta STOPHERE gamma"
    pieces, stopped, out = _stream(tokenizer, text, ["STOPHERE"])
    assert stopped and out == "alpha beta "
    for i in range(len(pieces)):
        assert "STOP" not in "".join(pieces[: i + 1])  # no partial stop string ever shown
    pieces, stopped, out = _stream(tokenizer, text, ["STOPHERE"], include=True)
    assert out == "alpha beta STOPHERE"
    # The earliest of several stop strings wins.
    _, _, out = _stream(tokenizer, text, ["gamma", "beta"])
    assert out == "alpha "


def test_held_back_prefix_released(tokenizer):
    """Held back prefix is released when no stop follows."""
    _, stopped, out = _stream(tokenizer, "total: STO and more", ["STOP"])
    assert not stopped and out == "total: STO and more"
    _, stopped, out = _stream(tokenizer, "ends with ST", ["STOP"])
    assert not stopped and out == "ends with ST", "finish() releases a held tail"


def test_chat_template_and_plain_fallback(tokenizer):
    msgs = [ChatMessage("system", "be kind"), ChatMessage("user", "hi")]
    rendered = tokenizer.render_chat(msgs)
    assert rendered.startswith("<s>") and rendered.endswith("<|assistant|>\n")
    assert "be kind" in rendered and "hi" in rendered
    ids = tokenizer.encode_chat(msgs)
    assert ids.count(1) == 1, "the template's BOS is not doubled"
    plain = Tokenizer(tokenizer.hf, tokenizer.eos_token_ids)
    original = tokenizer.hf.chat_template
    try:
        tokenizer.hf.chat_template = None
        assert not plain.has_chat_template
        assert plain.render_chat(msgs) == "system: be kind\nuser: hi\nassistant:"
        assert plain.encode_chat(msgs)[0] == 1  # special tokens added for the plain form
    finally:
        tokenizer.hf.chat_template = original


def test_load_reads_eos_ids(engine_assets, tmp_path):
    """Load reads generation eos IDs and fails clearly."""
    model = tmp_path / "model"
    shutil.copytree(engine_assets.demo.model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]
    (model / "generation_config.json").write_text(json.dumps(gen))
    tok = Tokenizer.load(model)
    assert tok.eos_token_ids == frozenset({2, 7})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.load(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises((ValueError, OSError)):
        Tokenizer.load(empty)
