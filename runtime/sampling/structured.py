"""Structured output: a request's text held to a JSON schema, a regex or a grammar.

Compiled with xgrammar (the library vLLM and SGLang use by default): a grammar is compiled
once against the tokenizer's vocabulary (cached by constraint), and each request gets its
own matcher, which says after every committed token which tokens may come next (a bitmask
over the vocabulary). The engine advances the matcher as tokens are committed; a
speculative verify asks for the masks of every draft position at once (:meth:`Constraint
.verify_masks`), walking the drafts and rolling back, so the verify applies exactly the mask
a plain step would have applied at each position.

xgrammar is imported on first use: a runtime that never sees a constrained request never
loads it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .params import SamplingParamsError, StructuredOutput

FIELD = "response_format"
_CACHE_SIZE = 64  # compiled grammars kept (by constraint); json_object is always one of them


class Constraint:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance past a committed token; False if the grammar does not allow it."""
        if self._matcher.is_terminated():
            return True  # the stop token that ended it, or text after it (ignore_eos)
        return bool(self._matcher.accept_token(int(token_id)))

    def allowed(self) -> torch.Tensor:
        """Bool ``[vocab]``: the tokens that may come next."""
        return self.verify_masks([])[0]

    def verify_masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """Bool ``[len(drafts) + 1, vocab]``: row ``j`` allows the tokens that may follow the
        committed text plus ``drafts[:j]``. Rows after a draft the grammar refuses repeat the
        refusing row (that draft is rejected there, so later rows are never used); rows after
        the grammar has ended (its stop token was drafted) allow everything, unused likewise."""
        import xgrammar as xgr

        rows = len(drafts) + 1
        bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        accepted = 0
        for j in range(rows):
            if self._matcher.is_terminated():
                bitmask[j:] = -1
                break
            self._matcher.fill_next_token_bitmask(bitmask, j)
            if j == rows - 1 or not self._matcher.accept_token(int(drafts[j])):
                bitmask[j + 1 :] = bitmask[j]
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return _unpack(bitmask, self.vocab_size)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask ``[rows, ceil(vocab/32)]`` as bool ``[rows, vocab]``."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (bitmask[:, :, None] >> bits) & 1
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class ConstraintCompiler:
    """Compiles constraints against one tokenizer; thread-safe, with a small cache."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._hf = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop = sorted(int(t) for t in stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, spec: StructuredOutput) -> Constraint:
        """A fresh matcher for ``spec`` (it rolls back any number of tokens, as a verify
        needs); :class:`SamplingParamsError` naming ``response_format`` when the schema,
        regex or grammar does not compile, or when xgrammar is not installed."""
        xgr = _xgrammar()
        return Constraint(xgr.GrammarMatcher(self._compiled(spec)), self._vocab_size)

    def _compiled(self, spec: StructuredOutput):
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            compiled = self._compile(spec)
            self._cache[spec] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: StructuredOutput):
        xgr = _xgrammar()

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._hf, vocab_size=self._vocab_size, stop_token_ids=self._stop or None
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        compiler = self._compiler
        try:
            if spec.kind == "json_object":
                # OpenAI's json_object is an object (the builtin JSON grammar allows any value);
                # no free whitespace, so a weak model cannot pad to max_tokens with blanks.
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                schema = json.loads(spec.spec)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is an object")
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            return compiler.compile_grammar(spec.spec)
        except (ValueError, RuntimeError, TypeError) as exc:
            what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(
                spec.kind, spec.kind
            )
            raise SamplingParamsError(FIELD, f"the {what} cannot be used: {_first_line(exc)}") from exc


def _xgrammar():
    """The xgrammar module, or a 400-worthy error naming what is missing (never a 500)."""
    try:
        import xgrammar
    except ImportError as exc:
        raise SamplingParamsError(
            FIELD,
            "structured output is not available on this server: the xgrammar package is not "
            f"installed ({exc}); install loraserve's dependencies, or send the request without a constraint",
        ) from exc
    return xgrammar


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
