"""Tiny models, tokenizers and adapters built locally, for tests, demos and benchmarks.

Everything here is made on the machine from nothing but installed packages: random
Llama-family weights through transformers, a byte-level BPE tokenizer trained on the
Python standard library's own sources, and PEFT LoRA adapters with randomised weights
(PEFT zero-initialises ``lora_B``, which would make every adapter a no-op). No model hub
is ever contacted. Results are deterministic for a seed on one installation.

Heavy imports (transformers, peft) happen inside the functions, so importing this
module stays cheap for code that only wants :class:`DemoAssets`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sysconfig
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A minimal chat format: role header, content, eos. Starts with bos, so a rendered chat
is tokenized with ``add_special_tokens=False``."""

# Standard-library sources the tokenizer is trained on: plenty of English and code,
# present on every Python installation.
_CORPUS_MODULES = (
    "argparse.py",
    "textwrap.py",
    "json/__init__.py",
    "json/decoder.py",
    "os.py",
    "collections/__init__.py",
    "dataclasses.py",
    "functools.py",
    "string.py",
    "shutil.py",
    "random.py",
    "calendar.py",
)

ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "gemma2",
    "gemma3",
    "phi3",
)

ALL_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

PHI3_LINEAR_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""Every linear module of a Phi-3 layer, as its checkpoints name them (fused q/k/v and gate/up):
peft's default ``target_modules`` for Phi-3."""


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in _CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise RuntimeError(f"no Python standard-library sources found under {stdlib} to train a tokenizer on")
    return texts


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE once per vocabulary size (per process); returns its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer.to_str()


def write_tokenizer(dest: str | Path, vocab_size: int = 512) -> Path:
    """Write tokenizer files to ``dest`` that ``AutoTokenizer.from_pretrained`` loads."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab} (256 bytes + special tokens), got {vocab_size}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    fast.save_pretrained(str(dest))
    return dest


def copy_tokenizer(src_dir: str | Path, dest: str | Path) -> None:
    """Copy a model directory's tokenizer files, so two models share one tokenizer."""
    src_dir, dest = Path(src_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copied = 0
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, dest / name)
            copied += 1
    if not (src_dir / "tokenizer.json").is_file() or not copied:
        raise FileNotFoundError(f"{src_dir} has no tokenizer.json to share")


def _gemma2_config(kwargs: dict, extra: dict):
    """A tiny Gemma 2 config: one rope (as given) for every layer, a window of 4, alternating
    sliding / global layers and transformers' caps (attention 50, logits 30) unless ``extra``
    (the ``moe`` argument, reused for Gemma's fields) says otherwise."""
    import transformers

    layers = kwargs["num_hidden_layers"]
    head_dim = kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    fields = {
        "sliding_window": 4,
        "query_pre_attn_scalar": head_dim,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        **extra,
    }
    config = transformers.Gemma2Config(**kwargs, **fields)
    config.architectures = ["Gemma2ForCausalLM"]
    return config, transformers.Gemma2ForCausalLM


def _gemma3_config(kwargs: dict, rope: dict, extra: dict):
    """A tiny Gemma 3 (text) config: global rope as given, local rope at Gemma's 10000, a
    window of 4 and alternating sliding / global layers unless ``extra`` (the ``moe`` argument,
    reused for Gemma's fields) says otherwise."""
    import transformers

    layers = kwargs["num_hidden_layers"]
    fields = {
        "sliding_window": 4,
        "query_pre_attn_scalar": kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"],
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        **extra,
    }
    kwargs = {**kwargs, "rope_parameters": {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    config = transformers.Gemma3TextConfig(**kwargs, **fields)
    config.architectures = ["Gemma3ForCausalLM"]
    return config, transformers.Gemma3ForCausalLM


def _model_config(
    architecture: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
    rope_scaling: dict | None,
    rope_theta: float,
    max_position_embeddings: int,
    initializer_range: float,
    head_dim: int | None,
    moe: dict | None = None,
):
    import transformers

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        rope = {**rope, **rope_scaling}
        rope.setdefault("rope_type", rope.get("type", "default"))
    kwargs["rope_parameters"] = rope
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if architecture == "llama":
        return transformers.LlamaConfig(**kwargs), transformers.LlamaForCausalLM
    if architecture == "mistral":
        return transformers.MistralConfig(sliding_window=None, **kwargs), transformers.MistralForCausalLM
    if architecture == "qwen2":
        kwargs.pop("head_dim", None)  # Qwen2 derives head_dim from hidden/heads
        return transformers.Qwen2Config(use_sliding_window=False, **kwargs), transformers.Qwen2ForCausalLM
    if architecture == "qwen3":
        return transformers.Qwen3Config(use_sliding_window=False, **kwargs), transformers.Qwen3ForCausalLM
    if architecture == "gemma2":
        return _gemma2_config(kwargs, moe or {})
    if architecture == "gemma3":
        return _gemma3_config(kwargs, rope, moe or {})
    if architecture == "phi3":  # ``moe``: Phi-3's own fields (partial_rotary_factor, sliding_window, ...)
        config = transformers.Phi3Config(**kwargs, **{"sliding_window": None, **(moe or {})})
        config.architectures = ["Phi3ForCausalLM"]
        return config, transformers.Phi3ForCausalLM
    moe = {**MOE_DEFAULTS, **(moe or {})}
    if architecture == "qwen3_moe":
        moe.setdefault("moe_intermediate_size", intermediate_size // 2)
        return (
            transformers.Qwen3MoeConfig(use_sliding_window=False, **kwargs, **moe),
            transformers.Qwen3MoeForCausalLM,
        )
    if architecture == "qwen2_moe":  # a gated shared expert beside the routed ones; q/k/v biases
        kwargs.pop("head_dim", None)  # Qwen2 derives head_dim from hidden/heads
        moe.setdefault("moe_intermediate_size", intermediate_size // 2)
        moe.setdefault("shared_expert_intermediate_size", intermediate_size)
        return (
            transformers.Qwen2MoeConfig(use_sliding_window=False, **kwargs, **moe),
            transformers.Qwen2MoeForCausalLM,
        )
    if architecture == "mixtral":
        moe["num_local_experts"] = moe.pop("num_experts")
        return transformers.MixtralConfig(sliding_window=None, **kwargs, **moe), transformers.MixtralForCausalLM
    raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")


MOE_DEFAULTS = {"num_experts": 4, "num_experts_per_tok": 2}
"""The tiny MoE models' experts; ``build_tiny_model(moe=...)`` adds or overrides config
fields (``norm_topk_prob``, ``mlp_only_layers``, ``moe_intermediate_size``, ...)."""


def build_tiny_model(
    dest: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: str = "float32",
    architecture: str = "llama",
    rope_theta: float = 10000.0,
    initializer_range: float = 0.05,
    head_dim: int | None = None,
    tokenizer_from: str | Path | None = None,
    moe: dict | None = None,
) -> Path:
    """Write a Hugging Face model directory with random weights and a local tokenizer.

    ``dest`` receives config.json, model.safetensors, generation_config.json and tokenizer
    files. ``architecture`` picks the layout: ``llama`` (Llama 2/3), ``mistral`` or
    ``qwen2`` (q/k/v biases), ``qwen3`` (per-head q/k norms), the mixture-of-experts
    ``qwen3_moe`` / ``qwen2_moe`` / ``mixtral`` (``moe``: expert config fields over :data:`MOE_DEFAULTS`,
    Qwen2-MoE's ``shared_expert_intermediate_size`` defaulting to ``intermediate_size``;
    transformers saves experts per expert, as published checkpoints hold them), ``gemma2``, ``gemma3`` or
    ``phi3`` (fused qkv_proj / gate_up_proj tensors; ``moe`` passes Gemma's and Phi-3's own
    config fields, e.g. ``partial_rotary_factor``). ``rope_scaling`` takes a transformers rope dict, e.g.
    ``{"rope_type": "llama3", "factor": 8.0, ...}``. ``tokenizer_from`` copies another
    model directory's tokenizer instead of training one (a draft shares its target's).
    ``initializer_range`` is larger than usual so a random model's logits are spread
    out and greedy choices are not decided by rounding noise.
    """
    from transformers import GenerationConfig

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config, model_cls = _model_config(
        architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        head_dim=head_dim,
        moe=moe,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        for name, param in model.named_parameters():
            # Zero-initialised biases and unit norm weights would leave those paths untested.
            if architecture == "qwen2" and name.endswith("bias"):
                torch.nn.init.normal_(param, std=initializer_range)
            elif architecture in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # scaled by 1 + w
                torch.nn.init.normal_(param, std=4 * initializer_range)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                torch.nn.init.normal_(param, mean=1.0, std=4 * initializer_range)
    model = model.to(torch_dtype)
    model.save_pretrained(str(dest))
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(str(dest))
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, dest)
    else:
        write_tokenizer(dest, vocab_size)
    return dest


def build_draft_model(
    dest: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 1,
    hidden_size: int = 32,
    num_layers: int = 1,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 64,
    dtype: str = "float32",
    architecture: str = "llama",
) -> Path:
    """A smaller model for speculative decoding with the target's vocabulary and tokenizer."""
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    return build_tiny_model(
        dest,
        vocab_size=int(target_config["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=int(target_config.get("max_position_embeddings", 1024)),
        seed=seed,
        dtype=dtype,
        tokenizer_from=target_dir,
        architecture=architecture,
    )


def copy_model(src_dir: str | Path, dest: str | Path) -> Path:
    """Copy a model directory: a draft identical to its target (every draft token accepted)."""
    dest = Path(dest)
    shutil.copytree(src_dir, dest, dirs_exist_ok=True)
    return dest


def build_adapter(
    dest: str | Path,
    base_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    init_std: float = 0.05,
    target_parameters: Sequence[str] | None = None,
) -> Path:
    """Write a PEFT LoRA adapter for ``base_dir`` with random A and B matrices.

    Saved by ``peft`` itself (adapter_config.json + adapter_model.safetensors), so the
    files are exactly what real training produces. ``embed_tokens`` / ``lm_head`` targets
    are supported; the base embedding weights are not copied into the adapter
    (``save_embedding_layers=False``), since the adapter does not change them.
    ``target_parameters``: peft's LoRA on parameters (an MoE model's fused routed experts,
    e.g. ``("gate_up_proj", "down_proj")``, where ``target_modules`` reach only Linear layers).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dest = Path(dest)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model.requires_grad_(False)
    lora_config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        target_parameters=list(target_parameters) if target_parameters else None,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft warns that a tied lm_head/embed_tokens pair is adapted without weight
        # tying; the runtime applies each module's own delta, which is what is wanted.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)  # transformers deprecations peft still calls
        peft_model = get_peft_model(model, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)
    peft_model.save_pretrained(str(dest), safe_serialization=True, save_embedding_layers=False)
    return dest


@dataclass
class DemoAssets:
    """Files the demo serves: a tiny base model, a draft sharing its tokenizer, adapters."""

    root: Path
    model_dir: Path
    draft_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)


DEMO_ADAPTERS = {
    # name: (rank, alpha, target modules, seed)
    "sql-r8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj"), 11),
    "chat-r16": (16, 32, ALL_LINEAR_MODULES, 12),
}


def _build_once(path: Path, build) -> None:
    """Build into a temporary sibling, then rename: a crash never leaves half a directory."""
    if (path / ".complete").is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_demo_assets(root: str | Path) -> DemoAssets:
    """Build the demo's model, draft and two adapters under ``root`` unless already there."""
    root = Path(root)
    model_dir = root / "model"
    draft_dir = root / "draft"
    _build_once(model_dir, lambda d: build_tiny_model(d, seed=0))
    _build_once(draft_dir, lambda d: build_draft_model(d, model_dir, seed=1))
    adapters: dict[str, Path] = {}
    for name, (rank, alpha, modules, seed) in DEMO_ADAPTERS.items():
        path = root / "adapters" / name
        _build_once(
            path,
            lambda d, r=rank, a=alpha, m=modules, s=seed: build_adapter(
                d, model_dir, rank=r, alpha=a, target_modules=m, seed=s
            ),
        )
        adapters[name] = path
    return DemoAssets(root=root, model_dir=model_dir, draft_dir=draft_dir, adapters=adapters)
