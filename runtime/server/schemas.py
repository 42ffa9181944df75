"""OpenAI request bodies, parsed and validated into typed requests.

Every rejection names the field (``param``) and says what would be accepted. Known fields
this server does not implement (tools, ``suffix``, beam search...) are refused when set to a
value that would change the result; purely informational ones (``user``) are accepted.
Fields it does not know are ignored and logged at warning level, once per request, as vLLM
does (its ``OpenAIBaseModel`` allows extra fields); README.md's "OpenAI API: what is
supported and what is refused" lists every field.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from ..sampling.params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    PENALTY_RANGE,
    StructuredOutput,
)
from ..sampling.structured_limits import MAX_ENUM_VALUES
from ..tokenizer import ChatMessage
from .errors import ApiError, invalid

log = logging.getLogger("loraserve.server")

MAX_N = 16
MAX_PROMPTS = 64
MAX_CHOICES = 128
"""Prompts × n per request: every choice is an engine request, and one call of more would
fill the running slots of a whole server."""
MAX_REQUEST_TOKENS = 65536
"""Prompts × n × max_tokens per request (tokens one call may ask the engine to generate);
one choice may always run to the model's context length."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:]{0,127}$")
MAX_JSON_DEPTH = 32
"""Arrays and objects nested deeper than this are refused (the deepest valid body, chat
content parts, nests 4 levels); Python's parser would otherwise recurse until it fails."""
MAX_LORA_PATH_CHARS = 4096
"""The longest ``lora_path`` accepted (Linux's PATH_MAX; URLs are shorter in practice)."""
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _json_depth_error() -> ApiError:
    return invalid(
        f"the request body is nested too deeply: JSON arrays and objects may be nested at most "
        f"{MAX_JSON_DEPTH} levels",
        code="invalid_json",
    )


def _check_depth(text: str, body: object) -> None:
    """Refuse bodies nested deeper than MAX_JSON_DEPTH (cheap: only walked when the text
    holds more brackets than the limit)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _json_depth_error()
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))


_SURROGATE_ESCAPE_RE = re.compile(r"\\u[dD][89abcdefABCDEF]")
"""A \\uD800-\\uDFFF escape: the only way a JSON text can hold a UTF-16 surrogate (raw
surrogate bytes are not valid UTF-8). Paired ones decode to one character; lone ones stay."""


def _check_surrogates(body: object) -> None:
    """Refuse a lone surrogate anywhere in the body, naming where (``adapters[0].source``):
    no field may carry one into a tokenizer, a path or a log."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            check_text(value, where or "body")
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            for key, v in value.items():
                check_text(key, f"{where}{'.' if where else ''}(a key)")
                stack.append((f"{where}.{key}" if where else key, v))


def check_text(value: str, param: str) -> str:
    """A string the tokenizer and UTF-8 can carry: JSON's ``\\ud800`` escapes decode to lone
    UTF-16 surrogates, which no encoder accepts."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(
            f"{param} contains a lone UTF-16 surrogate ({value[exc.start]!a} at character {exc.start}), "
            "which is not a Unicode character: send valid Unicode text (pair surrogates in \\u escapes)",
            param=param,
            code="invalid_value",
        ) from None
    return value


def parse_json_body(raw: bytes) -> dict:
    """Decode a request body: strict UTF-8, valid JSON, a JSON object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(
            f"the request body is not valid UTF-8 (bad byte at offset {exc.start}): send UTF-8 encoded JSON",
            code="invalid_encoding",
        ) from None
    if not text.strip():
        raise invalid("the request body is empty: send a JSON object", code="invalid_json")
    try:
        body = json.loads(text)
    except RecursionError:
        raise _json_depth_error() from None
    except json.JSONDecodeError as exc:
        raise invalid(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            code="invalid_json",
        ) from None
    except ValueError as exc:  # an integer literal past Python's digit limit
        raise invalid(
            f"the request body holds a number too long to read ({exc}): send numbers of at most "
            f"{sys.get_int_max_str_digits()} digits",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise invalid(
            f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    _check_depth(text, body)
    if _SURROGATE_ESCAPE_RE.search(text):
        _check_surrogates(body)
    return body


# ---------------------------------------------------------------------------- field readers
def _type_name(value: object) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), "null" if value is None else type(value).__name__)


def get_str(body: dict, name: str, *, required: bool = False, default: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise invalid(f"{name} is required", param=name, code="missing_field")
        return default
    if not isinstance(value, str):
        raise invalid(f"{name} must be a string, got {_type_name(value)}", param=name, code="invalid_type")
    return check_text(value, name)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(
            f"{name} must be true or false, got {_type_name(value)}", param=name, code="invalid_type"
        )
    return value


def get_int(
    body: dict,
    name: str,
    default: int | None = None,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {_type_name(value)}", param=name, code="invalid_type")
    if minimum is not None and value < minimum:
        raise invalid(f"{name} must be >= {minimum}, got {value}", param=name, code="invalid_value")
    if maximum is not None and value > maximum:
        raise invalid(f"{name} must be <= {maximum}, got {value}", param=name, code="invalid_value")
    return value


def get_float(
    body: dict, name: str, default: float, *, minimum: float | None = None, maximum: float | None = None
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(
            f"{name} must be a finite number, got {_type_name(value)}", param=name, code="invalid_type"
        )
    if minimum is not None and value < minimum:
        raise invalid(f"{name} must be >= {minimum}, got {value}", param=name, code="invalid_value")
    if maximum is not None and value > maximum:
        raise invalid(f"{name} must be <= {maximum}, got {value}", param=name, code="invalid_value")
    return float(value)


def _get_stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop must be a string or an array of strings", param="stop", code="invalid_type")
    if len(value) > MAX_STOP_STRINGS:
        raise invalid(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(value)}", param="stop")
    if any(not s for s in value):
        raise invalid("stop strings must not be empty", param="stop", code="invalid_value")
    for s in value:
        check_text(s, "stop")
    return tuple(value)


def _get_token_ids(body: dict, name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise invalid(f"{name} must be an array of integers", param=name, code="invalid_type")
    return tuple(value)


# ---------------------------------------------------------------------------- field policy
def _is_falsy(value: object) -> bool:
    return not value


def _one_of(*accepted: object):
    """A predicate: the value is None or one of ``accepted`` (the values that change nothing)."""
    return lambda value: value is None or value in accepted


@dataclass(frozen=True)
class Refusal:
    """A known field this server does not implement: refused when ``harmless`` is false."""

    harmless: Callable[[object], bool]
    reason: str


REFUSED_COMMON: dict[str, Refusal] = {
    "tools": Refusal(_is_falsy, "tool calling is not supported by this server: omit tools"),
    "tool_choice": Refusal(
        _one_of("none", "auto"),
        'tool calling is not supported by this server: omit tool_choice or send "none"',
    ),
    "functions": Refusal(_is_falsy, "function calling is not supported by this server: omit functions"),
    "function_call": Refusal(
        _one_of("none", "auto"), "function calling is not supported by this server: omit function_call"
    ),
    "use_beam_search": Refusal(
        _one_of(False), "beam search is not implemented by this server: omit use_beam_search"
    ),
    "prompt_logprobs": Refusal(
        _one_of(None),
        "prompt_logprobs is not implemented in vLLM's shape: on /v1/completions send echo: true with logprobs "
        "to get the prompt tokens' log-probabilities",
    ),
    "allowed_token_ids": Refusal(
        _is_falsy, "allowed_token_ids is not implemented: use logit_bias (-100 on the tokens to avoid)"
    ),
    "bad_words": Refusal(_is_falsy, "bad_words is not implemented: use logit_bias or stop"),
    "skip_special_tokens": Refusal(
        _one_of(True), "this server always skips special tokens in the text: omit skip_special_tokens"
    ),
    "truncate_prompt_tokens": Refusal(
        _one_of(None),
        "prompts are never truncated by this server: omit truncate_prompt_tokens and shorten the prompt",
    ),
    "return_tokens_as_token_ids": Refusal(
        _one_of(False), "return_tokens_as_token_ids is not implemented: omit it"
    ),
    "logits_processors": Refusal(
        _is_falsy, "custom logits processors are not accepted: omit logits_processors"
    ),
    "modalities": Refusal(
        lambda v: v is None or v == ["text"],
        'only text output is supported: omit modalities or send ["text"]',
    ),
    "audio": Refusal(_one_of(None), "audio output is not supported: omit audio"),
    "prediction": Refusal(_one_of(None), "predicted outputs are not supported: omit prediction"),
}
"""Known OpenAI and vLLM fields that would change the result if honoured: refused (400,
``unsupported_parameter``) unless set to the value that changes nothing."""

REFUSED_COMPLETION: dict[str, Refusal] = {
    "suffix": Refusal(_one_of(None), "suffix (insertion) is not supported by this server: omit it"),
}

REFUSED_CHAT: dict[str, Refusal] = {
    "echo": Refusal(_one_of(False), "echo is only supported on /v1/completions: omit it"),
    "add_generation_prompt": Refusal(
        _one_of(True), "the chat template always ends with the assistant's turn: omit add_generation_prompt"
    ),
    "continue_final_message": Refusal(_one_of(False), "continue_final_message is not implemented: omit it"),
    "chat_template": Refusal(
        _one_of(None), "the model's own chat template is always used: omit chat_template"
    ),
    "chat_template_kwargs": Refusal(_is_falsy, "chat_template_kwargs is not accepted: omit it"),
    "documents": Refusal(_is_falsy, "documents (RAG templates) are not supported: omit documents"),
}

INFORMATIONAL = frozenset(
    {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "request_id", "reasoning_effort"}
)
"""Accepted and without effect here: bookkeeping fields, and fields that only matter with
features this server refuses (``parallel_tool_calls``) or models it does not serve
(``reasoning_effort``)."""

COMMON_FIELDS = frozenset(
    {
        "model",
        "n",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "min_tokens",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    }
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


def _refuse_unsupported(body: dict, refused: dict[str, Refusal]) -> None:
    for name, rule in refused.items():
        if name in body and not rule.harmless(body[name]):
            raise invalid(rule.reason, param=name, code="unsupported_parameter")


def ignored_fields(body: dict, known: frozenset[str], refused: dict[str, Refusal]) -> list[str]:
    """The body's fields this server neither reads nor refuses (vLLM's behaviour: ignored,
    and logged)."""
    return sorted(k for k in body if k not in known and k not in refused and k not in INFORMATIONAL)


def _log_ignored(names: list[str], endpoint: str) -> None:
    """One warning per request, worded as vLLM's, so operators grep the same line."""
    if names:
        log.warning(
            "The following fields were present in the request but ignored: %s (%s)", set(names), endpoint
        )


# ---------------------------------------------------------------------------- logit processing
def _get_penalties(body: dict) -> dict[str, float]:
    values = {
        name: get_float(body, name, 0.0, minimum=-PENALTY_RANGE, maximum=PENALTY_RANGE)
        for name in ("presence_penalty", "frequency_penalty")
    }
    rep = get_float(body, "repetition_penalty", 1.0, maximum=10.0)
    if rep <= 0:
        raise invalid(
            f"repetition_penalty must be in (0, 10] (1 disables it), got {rep:g}",
            param="repetition_penalty",
            code="invalid_value",
        )
    values["repetition_penalty"] = rep
    return values


_TOKEN_ID_RE = re.compile(r"[0-9]{1,9}")


def _get_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (JSON keys, so strings) to a bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid(
            f'logit_bias must be an object mapping token ids to biases, e.g. {{"50256": -100}}, got '
            f"{_type_name(value)}",
            param="logit_bias",
            code="invalid_type",
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(
            f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(value)}",
            param="logit_bias",
            code="invalid_value",
        )
    out = []
    for key, bias in value.items():
        if not _TOKEN_ID_RE.fullmatch(key):
            raise invalid(
                f'logit_bias keys must be token ids written as non-negative integer strings (e.g. "50256"), '
                f"got {key[:40]!r}",
                param="logit_bias",
                code="invalid_value",
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise invalid(
                f"logit_bias[{key!r}] must be a number, got {_type_name(bias)}",
                param="logit_bias",
                code="invalid_type",
            )
        if abs(bias) > LOGIT_BIAS_RANGE:
            raise invalid(
                f"logit_bias[{key!r}] must be in [-100, 100], got {bias:g}",
                param="logit_bias",
                code="invalid_value",
            )
        out.append((int(key), float(bias)))
    return tuple(out)


# ---------------------------------------------------------------------------- structured output
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")


def regex_literal(text: str) -> str:
    """``text`` as a regular expression matching exactly it (only metacharacters escaped:
    the grammar engine's regex dialect need not know Python's extra escapes)."""
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


def _schema_text(value: object, param: str) -> str:
    """A JSON schema given as an object (or, as vLLM's ``guided_json`` allows, JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise invalid(
                f"{param} is not valid JSON: {exc.msg}", param=param, code="invalid_value"
            ) from None
    if not isinstance(value, dict):
        raise invalid(
            f"{param} must be a JSON schema (an object), got {_type_name(value)}",
            param=param,
            code="invalid_type",
        )
    return json.dumps(value, ensure_ascii=False)


def _nonempty_str(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"{param} must be a non-empty string", param=param, code="invalid_type")
    return value


def _choice_regex(value: object, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise invalid(
            f"{param} must be a non-empty array of non-empty strings", param=param, code="invalid_type"
        )
    if len(value) > MAX_ENUM_VALUES:
        raise invalid(
            f"{param} has {len(value)} choices; at most {MAX_ENUM_VALUES}: send fewer, or a guided_regex",
            param=param,
            code="invalid_value",
        )
    return "(" + "|".join(regex_literal(c) for c in value) + ")"


def _from_response_format(value: object) -> StructuredOutput | None:
    """OpenAI's ``response_format``: text (no constraint), json_object, json_schema."""
    param = "response_format"
    if not isinstance(value, dict):
        raise invalid(
            f'{param} must be an object such as {{"type": "json_object"}}, got {_type_name(value)}',
            param=param,
            code="invalid_type",
        )
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise invalid(
            f'{param}.type must be "text", "json_object" or "json_schema", got {kind!r}',
            param=f"{param}.type",
            code="unsupported_parameter",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid(
            f'{param}.json_schema is required with type "json_schema": {{"name": ..., "schema": {{...}}}}',
            param=f"{param}.json_schema",
            code="missing_field" if spec is None else "invalid_type",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(
            f"{param}.json_schema.name is required (a non-empty string)",
            param=f"{param}.json_schema.name",
            code="missing_field" if name is None else "invalid_type",
        )
    if spec.get("schema") is None:
        raise invalid(
            f"{param}.json_schema.schema is required (the JSON schema the output must match)",
            param=f"{param}.json_schema.schema",
            code="missing_field",
        )
    # ``strict`` is accepted either way: the output always matches the schema exactly.
    return StructuredOutput("json_schema", _schema_text(spec["schema"], f"{param}.json_schema.schema"))


_GUIDED = {
    "guided_json": lambda v, p: StructuredOutput("json_schema", _schema_text(v, p)),
    "guided_regex": lambda v, p: StructuredOutput("regex", _nonempty_str(v, p)),
    "guided_choice": lambda v, p: StructuredOutput("regex", _choice_regex(v, p)),
    "guided_grammar": lambda v, p: StructuredOutput("grammar", _nonempty_str(v, p)),
}
"""vLLM's (pre-0.10) extra fields for constrained decoding."""

_STRUCTURED_OUTPUTS = {
    "json": _GUIDED["guided_json"],
    "regex": _GUIDED["guided_regex"],
    "choice": _GUIDED["guided_choice"],
    "grammar": _GUIDED["guided_grammar"],
}
"""vLLM's newer ``structured_outputs`` object: one of these keys (or ``json_object: true``)."""


def _from_structured_outputs(value: object) -> list[tuple[str, StructuredOutput]]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid(f"{param} must be an object", param=param, code="invalid_type")
    found = [
        (f"{param}.{key}", reader(value[key], f"{param}.{key}"))
        for key, reader in _STRUCTURED_OUTPUTS.items()
        if value.get(key) is not None
    ]
    if value.get("json_object"):
        found.append((f"{param}.json_object", StructuredOutput("json_object")))
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS) - {"json_object"})
    if unknown:
        raise invalid(
            f"{param} takes one of json, regex, choice, grammar, json_object; {', '.join(unknown)} is not supported",
            param=f"{param}.{unknown[0]}",
            code="unsupported_parameter",
        )
    return found


def get_structured(body: dict) -> tuple[str, StructuredOutput] | None:
    """The request's output constraint and the field that carries it (OpenAI's
    ``response_format``, vLLM's ``guided_*`` or ``structured_outputs.*``); at most one."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.get("response_format") is not None:
        fmt = _from_response_format(body["response_format"])
        if fmt is not None:
            found.append(("response_format.json_schema.schema" if fmt.kind == "json_schema" else "response_format", fmt))
    for name, reader in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, reader(body[name], name)))
    if body.get("structured_outputs") is not None:
        found.extend(_from_structured_outputs(body["structured_outputs"]))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise invalid(
            f"one output constraint per request, got {len(found)} ({names}): send only one",
            param=found[1][0],
            code="conflicting_parameters",
        )
    return found[0] if found else None


@dataclass
class GenerationRequest:
    """What both APIs share once parsed."""

    model: str | None
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    ignored: tuple[str, ...] = ()
    """Fields of the body this server ignored (logged; see :func:`ignored_fields`)."""
    constraint_field: str | None = None
    """The field that carried ``params.structured``: the engine names every constraint it
    cannot compile ``response_format``; the API names the field the client sent."""
    max_tokens_field: str = "max_tokens"
    """The field that carried ``params.max_tokens`` (chat's ``max_completion_tokens`` or its
    older ``max_tokens``): errors about the limit name it."""


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise invalid("stream_options must be an object", param="stream_options", code="invalid_type")
    if not stream:
        raise invalid("stream_options is only allowed with stream: true", param="stream_options")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise invalid(
            "stream_options.include_usage must be true or false",
            param="stream_options.include_usage",
            code="invalid_type",
        )
    return include


def _common(
    body: dict,
    *,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int = 0,
    prompt_logprobs: int | None = None,
) -> GenerationRequest:
    model = get_str(body, "model")
    n = get_int(body, "n", 1, minimum=1, maximum=MAX_N)
    stream = get_bool(body, "stream")
    temperature = get_float(body, "temperature", 1.0, minimum=0.0)
    top_p = get_float(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {top_p}", param="top_p", code="invalid_value")
    top_k = get_int(body, "top_k", 0, minimum=-1)
    min_p = get_float(body, "min_p", 0.0, minimum=0.0, maximum=1.0)
    min_tokens = get_int(body, "min_tokens", 0, minimum=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid(
            f"min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}",
            param="min_tokens",
            code="invalid_value",
        )
    seed = get_int(body, "seed")
    structured = get_structured(body)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k or 0,
        min_p=min_p,
        seed=seed,
        stop=_get_stop(body),
        stop_token_ids=_get_token_ids(body, "stop_token_ids"),
        ignore_eos=get_bool(body, "ignore_eos"),
        min_tokens=min_tokens,
        logprobs=logprobs,
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_get_logit_bias(body),
        structured=structured[1] if structured else None,
        **_get_penalties(body),
    )
    return GenerationRequest(
        model=model,
        params=params,
        n=n or 1,
        stream=stream,
        include_usage=_stream_options(body, stream),
        constraint_field=structured[0] if structured else None,
    )


# ---------------------------------------------------------------------------- completions
@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False


def parse_completion(body: dict) -> CompletionRequest:
    """``POST /v1/completions``."""
    if "prompt" not in body or body["prompt"] is None:
        raise invalid(
            "prompt is required: a string, an array of strings, or an array of token ids",
            param="prompt",
            code="missing_field",
        )
    prompts = _parse_prompts(body["prompt"])
    _refuse_unsupported(body, REFUSED_COMMON | REFUSED_COMPLETION)
    if isinstance(body.get("logprobs"), bool):
        raise invalid(
            "logprobs must be an integer on /v1/completions (the number of alternatives per token, 0-20)",
            param="logprobs",
            code="invalid_type",
        )
    # The number of most likely alternatives reported per token (OpenAI's legacy bound is 5,
    # vLLM's 20); the chosen token's log-probability is always reported beside them.
    logprobs = get_int(body, "logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    best_of = get_int(body, "best_of")
    n = get_int(body, "n", 1, minimum=1, maximum=MAX_N)
    if best_of is not None and best_of != n:
        raise invalid("best_of must equal n (or be omitted)", param="best_of", code="unsupported_parameter")
    max_tokens = get_int(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, minimum=1)
    echo = get_bool(body, "echo")
    common = _common(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        # echo with logprobs reports the prompt's tokens first, with as many alternatives.
        prompt_logprobs=logprobs if echo and logprobs is not None else None,
    )
    if len(prompts) * common.n > MAX_CHOICES:
        raise invalid(
            f"prompt × n is {len(prompts)} prompts × {common.n} = {len(prompts) * common.n} choices: at most "
            f"{MAX_CHOICES} per request; send fewer prompts or a smaller n, or split the prompts across requests",
            param="n",
            code="too_many_choices",
        )
    common.ignored = tuple(ignored_fields(body, COMPLETION_FIELDS, REFUSED_COMMON | REFUSED_COMPLETION))
    _log_ignored(list(common.ignored), "/v1/completions")
    return CompletionRequest(**common.__dict__, prompts=prompts, echo=echo)


def _parse_prompts(value: object) -> list[str | list[int]]:
    def is_ids(v: object) -> bool:
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str):
        prompts: list = [value]
    elif is_ids(value) and value:
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or (is_ids(p) and p) for p in value):
        prompts = list(value)
    else:
        raise invalid(
            "prompt must be a string, an array of strings, an array of token ids, or an array of such arrays "
            "(none empty)",
            param="prompt",
            code="invalid_type",
        )
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            check_text(p, "prompt" if isinstance(value, str) else f"prompt[{i}]")
    return prompts


# ---------------------------------------------------------------------------- chat
@dataclass
class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = field(default_factory=list)


def parse_chat(body: dict) -> ChatRequest:
    """``POST /v1/chat/completions``."""
    messages = _parse_messages(body.get("messages"))
    _refuse_unsupported(body, REFUSED_COMMON | REFUSED_CHAT)
    max_tokens = get_int(body, "max_completion_tokens", None, minimum=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, minimum=1)
    logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top and not logprobs:
        # OpenAI's rule: top_logprobs is only read with logprobs: true.
        raise invalid("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    common = _common(body, max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top or 0)
    if body.get("max_completion_tokens") is not None:
        common.max_tokens_field = "max_completion_tokens"
    common.ignored = tuple(ignored_fields(body, CHAT_FIELDS, REFUSED_COMMON | REFUSED_CHAT))
    _log_ignored(list(common.ignored), "/v1/chat/completions")
    return ChatRequest(**common.__dict__, messages=messages)


def _parse_messages(value: object) -> list[ChatMessage]:
    if value is None:
        raise invalid(
            "messages is required: an array of {role, content} objects",
            param="messages",
            code="missing_field",
        )
    if not isinstance(value, list) or not value:
        raise invalid(
            "messages must be a non-empty array of {role, content} objects",
            param="messages",
            code="invalid_type",
        )
    out: list[ChatMessage] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(
                f"{where} must be an object with role and content", param=where, code="invalid_type"
            )
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise invalid(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                param=f"{where}.role",
                code="invalid_value",
            )
        out.append(
            ChatMessage(role=role, content=_content_text(msg.get("content"), f"{where}.content", role))
        )
    return out


def _content_text(content: object, where: str, role: str) -> str:
    if content is None:
        if role == "assistant":
            return ""
        raise invalid(f"{where} is required", param=where, code="missing_field")
    if isinstance(content, str):
        return check_text(content, where)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(
                    f'{where}[{j}] must be {{"type": "text", "text": ...}}; only text is supported',
                    param=f"{where}[{j}]",
                    code="invalid_type",
                )
            parts.append(check_text(part["text"], f"{where}[{j}].text"))
        return "".join(parts)
    raise invalid(
        f"{where} must be a string or an array of text parts, got {_type_name(content)}",
        param=where,
        code="invalid_type",
    )


# ---------------------------------------------------------------------------- admin
@dataclass
class DraftSource:
    """An Adapter's draft adapter: where its LoRA for the serve's draft comes from."""

    lora_path: str
    sha256: str | None = None


@dataclass
class LoadAdapterRequest:
    lora_name: str
    lora_path: str
    sha256: str | None = None
    pinned: bool = False
    warm: bool = True
    """Kept loaded (never evicted for on-demand loads); false: evictable when idle."""
    draft: DraftSource | None = None


def check_adapter_name(name: str, param: str = "lora_name") -> str:
    if not ADAPTER_NAME_RE.match(name):
        raise invalid(
            f"{param} {name!r} is not a valid adapter name: 1-128 characters of letters, digits and . _ - / :, "
            "starting with a letter or digit",
            param=param,
            code="invalid_value",
        )
    return name


def parse_load_adapter(body: dict) -> LoadAdapterRequest:
    """``POST /v1/load_lora_adapter``: ``{lora_name, lora_path, sha256?, pinned?, warm?,
    draft?: {lora_path, sha256?}}``."""
    name = check_adapter_name(get_str(body, "lora_name", required=True) or "")
    path, sha = _adapter_source(body, "")
    return LoadAdapterRequest(
        name, path, sha, get_bool(body, "pinned"), get_bool(body, "warm", True), _draft_source(body)
    )


def _draft_source(body: dict) -> DraftSource | None:
    draft = body.get("draft")
    if draft is None:
        return None
    if not isinstance(draft, dict):
        raise invalid("draft must be an object {lora_path, sha256?}", param="draft", code="invalid_type")
    return DraftSource(*_adapter_source(draft, "draft."))


def _nested_str(body: dict, key: str, prefix: str, *, required: bool = False) -> str | None:
    """:func:`get_str` of ``body[key]`` where ``body`` sits at ``prefix`` in the request:
    its errors name ``prefix + key`` (``draft.lora_path``)."""
    return get_str({prefix + key: body.get(key)}, prefix + key, required=required)


def _adapter_source(body: dict, prefix: str) -> tuple[str, str | None]:
    """``lora_path`` and ``sha256`` of a load body (or its ``draft``), checked."""
    param = f"{prefix}lora_path"
    path = _nested_str(body, "lora_path", prefix, required=True) or ""
    if not path.strip():
        raise invalid(f"{param} must not be empty", param=param, code="invalid_value")
    if len(path) > MAX_LORA_PATH_CHARS:
        raise invalid(
            f"{param} is {len(path)} characters long: the maximum length is {MAX_LORA_PATH_CHARS}",
            param=param,
            code="invalid_value",
        )
    bad = _CONTROL_RE.search(path)
    if bad:
        raise invalid(
            f"{param} contains the control character {bad.group()!a} at character {bad.start()}: "
            "send a path or URL without control characters",
            param=param,
            code="invalid_value",
        )
    sha = _nested_str(body, "sha256", prefix)
    if sha is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", sha):
        raise invalid(
            f"{prefix}sha256 must be 64 hexadecimal characters", param=f"{prefix}sha256", code="invalid_value"
        )
    return path.strip(), sha.lower() if sha else None


def parse_unload_adapter(body: dict) -> str:
    """``POST /v1/unload_lora_adapter``: ``{lora_name}``."""
    return check_adapter_name(get_str(body, "lora_name", required=True) or "")


__all__ = [
    "MAX_CHOICES",
    "MAX_REQUEST_TOKENS",
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "GenerationRequest",
    "LoadAdapterRequest",
    "parse_chat",
    "parse_completion",
    "parse_json_body",
    "parse_load_adapter",
    "parse_unload_adapter",
]
