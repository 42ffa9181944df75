"""Tiny models and adapters built once per session, plus runner / reference factories.

Every model here is built locally by ``loraserve.runtime.dev.devmodels``; references are
transformers (+ peft) on the very same files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.contract.config import LORA_MODULES, RuntimeConfig
from loraserve.runtime.dev.devmodels import ALL_LINEAR_MODULES, build_adapter, build_tiny_model
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

MODEL_KINDS = {
    # name: build_tiny_model kwargs
    "llama-gqa": {},
    "llama-tied-mha": {"tie_word_embeddings": True, "num_kv_heads": 4, "seed": 1},
    "qwen2-bias": {"architecture": "qwen2", "seed": 2},
    "llama3-rope": {"rope_scaling": LLAMA3_ROPE, "seed": 3, "num_kv_heads": 1},
    "mistral-window": {"architecture": "mistral", "seed": 4},
    "qwen3-qknorm": {"architecture": "qwen3", "seed": 5, "head_dim": 32},
}

ADAPTERS = {
    # name: build_adapter kwargs (on the llama-gqa model)
    "attn-r8": {"rank": 8, "alpha": 16, "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj"), "seed": 10},
    "all-r16": {"rank": 16, "alpha": 32, "target_modules": ALL_LINEAR_MODULES, "seed": 11},
    "mlp-r4-rs": {"rank": 4, "alpha": 8, "target_modules": ("gate_proj", "up_proj", "down_proj"), "use_rslora": True, "seed": 12},
    "emb-head": {"rank": 8, "alpha": 16, "target_modules": ("embed_tokens", "lm_head", "v_proj"), "seed": 13},
}


@dataclass
class Assets:
    models: dict[str, Path]
    adapters: dict[str, Path]


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Assets:
    root = tmp_path_factory.mktemp("runtime_model_assets")
    models = {}
    for name, kwargs in MODEL_KINDS.items():
        models[name] = build_tiny_model(root / name, **kwargs)
    # Mistral with a window shorter than the test prompts, so the window matters.
    import json

    cfg_path = models["mistral-window"] / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["sliding_window"] = 6
    cfg_path.write_text(json.dumps(cfg))
    adapters = {}
    for name, kwargs in ADAPTERS.items():
        adapters[name] = build_adapter(root / "adapters" / name, models["llama-gqa"], **kwargs)
    return Assets(models=models, adapters=adapters)


def runtime_config(model_dir: Path, **lora) -> RuntimeConfig:
    config = RuntimeConfig()
    config.model.path = str(model_dir)
    config.device = "cpu"
    config.scheduler.max_total_tokens = 4096
    config.scheduler.max_running_requests = 16
    config.lora.max_rank = lora.pop("max_rank", 16)
    config.lora.max_loras_per_batch = lora.pop("max_loras_per_batch", 4)
    config.lora.max_loaded_loras = lora.pop("max_loaded_loras", 8)
    config.lora.target_modules = tuple(lora.pop("target_modules", LORA_MODULES))
    config.lora.backend = lora.pop("backend", "torch")
    assert not lora, lora
    return config


@pytest.fixture
def make_runner():
    """``make_runner(model_dir, adapters={name: path}, is_draft=False, **lora_overrides)``."""

    def make(model_dir: Path, adapters: dict[str, Path] | None = None, is_draft: bool = False, **lora) -> ModelRunner:
        config = runtime_config(model_dir, **lora)
        runner = ModelRunner(config, is_draft=is_draft, model_path=model_dir if is_draft else None)
        for name, path in (adapters or {}).items():
            runner.lora.load(name, path)
        return runner

    return make


@pytest.fixture
def static_graph_pair(assets, make_runner):
    """``static_graph_pair(adapter_names, **graph_kwargs) -> (eager, graphed)``: two runners of
    the llama-gqa model with those test adapters loaded; ``graphed`` runs decode / verify /
    prefill batches through a :class:`CudaGraphRunner` on its padded static path
    (``use_graphs=False``: everything but the capture, on the CPU)."""
    from loraserve.runtime.runner.cuda_graph import CudaGraphRunner

    def make(adapter_names, **graph_kwargs) -> tuple[ModelRunner, ModelRunner]:
        names = {n: assets.adapters[n] for n in adapter_names}
        eager = make_runner(assets.models["llama-gqa"], adapters=names)
        graphed = make_runner(assets.models["llama-gqa"], adapters=names)
        graphed.graphs = CudaGraphRunner(graphed, use_graphs=False, **graph_kwargs)
        return eager, graphed

    return make


_HF_CACHE: dict[tuple[str, str | None], torch.nn.Module] = {}


@pytest.fixture
def hf_model():
    """``hf_model(model_dir, adapter_dir=None)``: transformers (+ peft) reference, cached."""

    def load(model_dir: Path, adapter_dir: Path | None = None):
        key = (str(model_dir), None if adapter_dir is None else str(adapter_dir))
        if key not in _HF_CACHE:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            if adapter_dir is not None:
                import warnings

                from peft import PeftModel

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # transformers deprecations peft calls
                    model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
            _HF_CACHE[key] = model
        return _HF_CACHE[key]

    return load


def extend(runner, rids, seqs, names=None, all_logits=False, **kw):
    ids = torch.cat([torch.as_tensor(s, dtype=torch.int64) for s in seqs])
    return runner.forward(
        ForwardBatch(
            ForwardMode.EXTEND,
            list(rids),
            ids,
            extend_lens=[len(s) for s in seqs],
            lora_names=names,
            return_all_logits=all_logits,
            **kw,
        )
    )


def decode(runner, rids, tokens, names=None, **kw):
    return runner.forward(
        ForwardBatch(ForwardMode.DECODE, list(rids), torch.as_tensor(tokens, dtype=torch.int64), lora_names=names, **kw)
    )


def verify(runner, rids, blocks, names=None, **kw):
    k = len(blocks[0])
    ids = torch.cat([torch.as_tensor(b, dtype=torch.int64) for b in blocks])
    return runner.forward(
        ForwardBatch(ForwardMode.TARGET_VERIFY, list(rids), ids, num_draft_tokens=k, lora_names=names, **kw)
    )


@pytest.fixture
def ops():
    """The batch helpers: ``ops.extend``, ``ops.decode``, ``ops.verify``."""

    class Ops:
        pass

    o = Ops()
    o.extend, o.decode, o.verify = extend, decode, verify
    return o


@pytest.fixture
def make_config():
    """``make_config(model_dir, **lora_overrides) -> RuntimeConfig`` for CPU tests."""
    return runtime_config
