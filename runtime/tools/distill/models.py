"""The two models of a distillation and the adapter it writes.

The teacher is the ADAPTED target (base + the user's PEFT adapter), frozen, in eval mode:
its next-token distribution is what the draft should predict on that adapter's requests.
The student is the STANDALONE draft with a fresh PEFT LoRA (``lora_B`` starts at zero, so
before training it computes exactly the shared, unadapted draft); only the LoRA trains.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ...contract.config import DEFAULT_LORA_MODULES

# The runtime's draft-adapter pool wraps the draft's linear layers only, never embed_tokens or
# lm_head (README, "Draft adapters"): a draft adapter on those would be refused at admission.
DRAFT_LORA_MODULES = DEFAULT_LORA_MODULES


class DistillError(ValueError):
    """A setting or input of the distillation that cannot work; the message names the fix."""


@dataclass(frozen=True)
class LoraSettings:
    """The draft LoRA's shape: written as peft writes it, read back by the runtime's loader."""

    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = DRAFT_LORA_MODULES

    def check(self) -> None:
        if self.rank < 1:
            raise DistillError(f"--rank must be a positive integer, got {self.rank}")
        if not self.target_modules:
            raise DistillError(
                "--target-modules is empty: name at least one of " + ",".join(DRAFT_LORA_MODULES)
            )
        unknown = sorted(set(self.target_modules) - set(DRAFT_LORA_MODULES))
        if unknown:
            raise DistillError(
                f"--target-modules has {unknown}: the runtime's draft adapters adapt "
                f"{','.join(DRAFT_LORA_MODULES)} (short names, as the runtime names them; never embed_tokens "
                "or lm_head)"
            )


@dataclass
class Vocabulary:
    """What the two models agree on: the token ids both score, and the logit widths."""

    width: int  # logit columns compared: min of the two models' vocab_size
    target_size: int
    draft_size: int
    tokenizer_checked: bool  # False when the draft directory has no tokenizer to compare


def check_model_dir(path: str | Path, flag: str, what: str) -> Path:
    """A local Hugging Face model directory (config.json present), or a clear refusal."""
    path = Path(path)
    if not path.is_dir():
        raise DistillError(f"{flag} {str(path)!r} is not a directory: give the local folder of the {what}")
    if not (path / "config.json").is_file():
        raise DistillError(
            f"{flag} {str(path)!r} has no config.json: give a Hugging Face model folder for the {what} "
            "(config.json + safetensors weights)"
        )
    return path


def check_adapter_dir(path: str | Path) -> Path:
    """The target adapter's folder: peft's adapter_config.json must be in it."""
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise DistillError(
            f"--adapter {str(path)!r} has no adapter_config.json: give the folder peft's save_pretrained "
            "wrote for the target's adapter (adapter_config.json + adapter_model.safetensors)"
        )
    return path


def require_peft() -> None:
    """peft is an optional dependency of the package (the ``realmodel`` extra): say so up front."""
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        raise DistillError(
            "this command needs peft, which is not installed: pip install 'loraserve[realmodel]' (or peft>=0.13)"
        ) from exc


def load_tokenizer(model_dir: Path):
    """A model folder's tokenizer (local files only), or None when it has none."""
    from transformers import AutoTokenizer

    if not any(
        (model_dir / name).is_file()
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    ):
        return None
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _vocab_size(model_dir: Path) -> int:
    raw = json.loads((model_dir / "config.json").read_text())
    size = raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int):
        raise DistillError(f"{model_dir / 'config.json'} has no integer vocab_size")
    return size


def check_vocabulary(target_dir: Path, draft_dir: Path, target_tokenizer, draft_tokenizer) -> Vocabulary:
    """Refuse a draft whose token ids do not mean what the target's mean.

    A STANDALONE draft proposes token ids the target verifies, so it must use the target's
    tokenizer. The two configs' ``vocab_size`` may still differ (padding rows, as Qwen2.5's
    sizes do): the logits are compared over the common width, as the runtime does
    (``speculative.drafter.fit_vocab``), provided every real token id fits in it."""
    target_size, draft_size = _vocab_size(target_dir), _vocab_size(draft_dir)
    fix = (
        "a STANDALONE draft must use the target's tokenizer: pick a draft model of the target's family "
        "(trained with the same tokenizer), or serve this adapter with EAGLE / NGRAM speculation instead"
    )
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise DistillError(
            f"the draft at {draft_dir} has a different tokenizer vocabulary from the target at {target_dir} "
            f"({len(draft_tokenizer)} vs {len(target_tokenizer)} tokens): {fix}"
        )
    width = min(target_size, draft_size)
    if draft_tokenizer is None and target_size != draft_size:
        raise DistillError(
            f"the draft at {draft_dir} has no tokenizer and vocab_size {draft_size}, the target at {target_dir} "
            f"has {target_size}: {fix}"
        )
    if len(target_tokenizer) > width:
        raise DistillError(
            f"the tokenizer has {len(target_tokenizer)} tokens but the draft scores only {draft_size} "
            f"(the target {target_size}): {fix}"
        )
    return Vocabulary(width, target_size, draft_size, tokenizer_checked=draft_tokenizer is not None)


def _quietly(fn, *args, **kwargs):
    """peft/transformers warnings about tied weights and deprecations say nothing the user can act on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return fn(*args, **kwargs)


def _load_causal_lm(model_dir: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = _quietly(AutoModelForCausalLM.from_pretrained, str(model_dir), dtype=dtype, local_files_only=True)
    return model.to(device)


def load_teacher(target_dir: Path, adapter_dir: Path, dtype: torch.dtype, device: str):
    """The adapted target, frozen and in eval mode (no dropout: the distribution served)."""
    from peft import PeftModel

    base = _load_causal_lm(target_dir, dtype, device)
    try:
        model = _quietly(PeftModel.from_pretrained, base, str(adapter_dir), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise DistillError(
            f"the adapter at {adapter_dir} does not load onto the target at {target_dir} ({exc}): "
            "give the adapter trained for this target"
        ) from exc
    model.requires_grad_(False)
    return model.eval()


def _check_modules_exist(model, modules: Sequence[str], draft_dir: Path) -> None:
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(modules) - present)
    if missing:
        raise DistillError(
            f"the draft at {draft_dir} has no {missing} modules: leave them out of --target-modules"
        )


def load_student(draft_dir: Path, lora: LoraSettings, dtype: torch.dtype, device: str):
    """The draft with a fresh LoRA; its base is frozen, only the LoRA matrices train."""
    from peft import LoraConfig, get_peft_model

    draft = _load_causal_lm(draft_dir, dtype, device)
    draft.requires_grad_(False)
    _check_modules_exist(draft, lora.target_modules, draft_dir)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=list(lora.target_modules),
        lora_dropout=0.0,  # the runtime serves W + s·B·A; dropout would only add noise to a distillation
        bias="none",
        task_type="CAUSAL_LM",
    )
    # peft keeps the LoRA matrices in float32 beside a bf16 base (autocast_adapter_dtype), so
    # small updates are not lost to bf16 rounding.
    student = _quietly(get_peft_model, draft, config)
    student.config.use_cache = False
    return student


def save_adapter(student, out_dir: Path) -> list[str]:
    """Write the LoRA as peft does by default, minus whole embedding copies; returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # save_embedding_layers=False: the LoRA never changes embed_tokens / lm_head themselves, and
    # the runtime would otherwise have to check a full copy of them against the served draft.
    _quietly(student.save_pretrained, str(out_dir), safe_serialization=True, save_embedding_layers=False)
    return sorted(p.name for p in out_dir.iterdir() if p.is_file())


def check_written_adapter(out_dir: Path, draft_dir: Path, lora: LoraSettings) -> None:
    """Read the written adapter back through the runtime's own loader, against the draft."""
    from ...lora.adapter import load_adapter
    from ...lora.errors import AdapterError
    from ...model.arch import load_arch_config

    try:
        load_adapter(
            out_dir,
            arch=load_arch_config(draft_dir),
            max_rank=lora.rank,
            pool_modules=lora.target_modules,
            dtype=torch.float32,
            base_tensor=None,
        )
    except AdapterError as exc:  # a bug here, not the user's: say so plainly
        raise DistillError(
            f"the written adapter at {out_dir} is refused by the runtime's loader: {exc}"
        ) from exc
