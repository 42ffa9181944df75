"""The serving tokenizer: encoding, chat templates and incremental detokenisation.

Loaded with ``transformers.AutoTokenizer`` from local files only. Streaming needs text
deltas that never split a multi-byte character: :class:`IncrementalDetokenizer` decodes a
short sliding window of ids and holds text back while it ends in an incomplete character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPLACEMENT_CHAR = "\ufffd"
# Up to this many trailing prompt ids seed a detokenizer's window, so a first output token
# whose text depends on its left neighbour (a SentencePiece leading space) decodes right.
_WINDOW_SEED = 5
# A UTF-8 character spans at most 4 bytes, so a longer incomplete tail is invalid output:
# emit it rather than hold it forever.
_MAX_HELD_IDS = 8


@dataclass
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    """A thin, typed wrapper over a Hugging Face tokenizer."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        ids = set(int(i) for i in eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(ids)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load from a local model directory (never the network).

        End-of-sequence ids come from the tokenizer and, when present, from the model's
        ``generation_config.json`` (which may list several, as Llama-3 does).
        """
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises many types for a broken directory
            raise ValueError(
                f"cannot load a tokenizer from {str(path)!r}: {exc}. The model directory needs "
                "tokenizer.json (or tokenizer.model) and tokenizer_config.json"
            ) from exc
        return cls(hf, _generation_eos_ids(path))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text for a chat, ending where the assistant's reply begins.

        Uses the tokenizer's own chat template; without one, a plain ``role: content``
        transcript ending in ``assistant:``.
        """
        plain = [{"role": m.role, "content": m.content} for m in messages]
        if self.has_chat_template:
            return self.hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        lines = [f"{m.role}: {m.content}" for m in messages]
        lines.append("assistant:")
        return "\n".join(lines)

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of :meth:`render_chat`'s prompt.

        A chat template writes its own BOS, so special tokens are added only for the plain
        fallback.
        """
        text = self.render_chat(messages)
        return self.encode(text, add_special_tokens=not self.has_chat_template)

    def detokenizer(
        self, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas for streaming.

    Each call decodes the window ``ids[prefix:]`` and the already-emitted part
    ``ids[prefix:read]``; the difference is new text. While the window's text ends in
    U+FFFD (an incomplete multi-byte character) nothing is emitted, so a character is never
    split across deltas. ``text`` is everything emitted so far.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        seed = list(prompt_ids[-_WINDOW_SEED:]) if prompt_ids else []
        self._ids: list[int] = seed
        self._prefix = 0
        self._read = len(seed)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one output id; return the text it completes (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        if window_text.endswith(REPLACEMENT_CHAR) and held < _MAX_HELD_IDS:
            return ""
        # Beyond what the window's emitted part already decodes to; a window whose text
        # re-segmented earlier characters still emits only past the emitted length.
        delta = window_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        # Keep the window short: the ids before the new prefix are never decoded again.
        if self._prefix > 0:
            self._ids = self._ids[self._prefix :]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit whatever is still held (an incomplete tail)."""
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        delta = window_text[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


def _generation_eos_ids(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos if isinstance(e, int)]
