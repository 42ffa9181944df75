"""How large a KV pool the runtime reserves when ``scheduler.max_total_tokens`` is unset.

On a GPU: ``kv_memory_fraction`` of the free memory, capped by what the limits can occupy
(unchanged). On a CPU the memory is the machine's: the pool is the smallest of that demand,
``min(kv_memory_fraction, 25%)`` of the available memory and 4 GiB (issue: the runtime used
to reserve about 18 GiB for SmolLM2-135M on a 24 GiB machine).
"""

from __future__ import annotations

import logging

import pytest
import torch

from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.dev.devmodels import build_tiny_model
from loraserve.runtime.kv import KVCacheError, budget
from loraserve.runtime.kv.budget import (
    CPU_KV_MAX_BYTES,
    KVBudget,
    kv_bytes_per_token,
    plan_kv_budget,
)

GIB = 2**30
DEFAULTS = RuntimeConfig().scheduler
# The runner holds twice max_running_requests request rows (model_runner.py).
DEFAULT_ROWS = 2 * DEFAULTS.max_running_requests

# SmolLM2-135M: 30 layers, 3 KV heads of 64, 8192 positions; float32 on CPU.
SMOL_BPT = kv_bytes_per_token(30, 3, 64, torch.float32)
SMOL_CONTEXT = 8192
# The demo's tiny model: 2 layers, 2 KV heads of 16, 1024 positions, float32.
TINY_BPT = kv_bytes_per_token(2, 2, 16, torch.float32)


def plan(device_type="cpu", *, available, bpt, context, rows=DEFAULT_ROWS, fraction=None, requested=None):
    return plan_kv_budget(
        requested=requested,
        bytes_per_token=bpt,
        device_type=device_type,
        available_bytes=available,
        memory_fraction=DEFAULTS.kv_memory_fraction if fraction is None else fraction,
        max_requests=rows,
        max_context_len=context,
    )


def test_smollm2_budget_on_24_gib():
    """SmolLM2 on a 24 GiB machine gets at most 4 GiB on CPU and the same as before on GPU."""
    assert SMOL_BPT == 46080
    available = 23 * GIB  # MemAvailable of an idle 24 GiB machine
    cpu = plan(available=available, bpt=SMOL_BPT, context=SMOL_CONTEXT)
    assert cpu.limited_by == "cpu_cap"
    assert cpu.tokens == CPU_KV_MAX_BYTES // SMOL_BPT == 93206
    assert cpu.bytes <= 4 * GIB
    assert "max_total_tokens" in cpu.reason  # says how to get more
    # The old rule (and still the GPU rule): 0.85 of what is free, about 19.5 GiB here.
    gpu = plan("cuda", available=available, bpt=SMOL_BPT, context=SMOL_CONTEXT)
    assert gpu.limited_by == "memory_fraction"
    assert gpu.tokens == int(available * 0.85) // SMOL_BPT
    assert gpu.bytes > 19 * GIB


def test_small_machine_gives_quarter():
    """A small machine gives a quarter of its available memory."""
    cpu = plan(available=6 * GIB, bpt=SMOL_BPT, context=SMOL_CONTEXT)
    assert cpu.limited_by == "cpu_share"
    assert cpu.tokens == int(6 * GIB * 0.25) // SMOL_BPT
    # A lower kv_memory_fraction lowers it further.
    low = plan(available=6 * GIB, bpt=SMOL_BPT, context=SMOL_CONTEXT, fraction=0.1)
    assert low.limited_by == "memory_fraction"
    assert low.tokens == int(6 * GIB * 0.1) // SMOL_BPT


def test_pool_within_limits():
    """A pool never exceeds what the limits can occupy."""
    for device_type in ("cpu", "cuda"):
        tiny = plan(device_type, available=23 * GIB, bpt=TINY_BPT, context=1024)
        assert tiny == KVBudget(DEFAULT_ROWS * 1024, DEFAULT_ROWS * 1024 * TINY_BPT, "demand", tiny.reason)
    assert tiny.bytes == 64 * 2**20  # 64 MiB: 128 rows x 1024 tokens x 512 bytes


def test_explicit_max_total_tokens_wins():
    """An explicit max total tokens wins on CPU even above the defaults caps."""
    big = plan(available=23 * GIB, bpt=SMOL_BPT, context=SMOL_CONTEXT, requested=200_000)
    assert (big.tokens, big.limited_by) == (200_000, "max_total_tokens")
    assert big.bytes > CPU_KV_MAX_BYTES
    # On CUDA it must fit in free memory.
    with pytest.raises(KVCacheError, match="max_total_tokens=200000 needs"):
        plan("cuda", available=4 * GIB, bpt=SMOL_BPT, context=SMOL_CONTEXT, requested=200_000)


def test_bad_settings_and_no_memory_are_errors():
    with pytest.raises(KVCacheError, match="kv_memory_fraction"):
        plan(available=GIB, bpt=SMOL_BPT, context=SMOL_CONTEXT, fraction=1.5)
    with pytest.raises(KVCacheError, match="max_total_tokens must be >= 1"):
        plan(available=GIB, bpt=SMOL_BPT, context=SMOL_CONTEXT, requested=0)
    with pytest.raises(KVCacheError, match="no memory left"):
        plan(available=SMOL_BPT, bpt=SMOL_BPT, context=SMOL_CONTEXT)


def _unbudgeted_config(model_dir, **scheduler) -> RuntimeConfig:
    """The runtime's defaults on CPU, with no max_total_tokens: the pool is derived."""
    cfg = RuntimeConfig()
    cfg.model.path = str(model_dir)
    cfg.device = "cpu"
    cfg.lora.enabled = False
    assert cfg.scheduler.max_total_tokens is None
    for key, value in scheduler.items():
        setattr(cfg.scheduler, key, value)
    return cfg


def test_tiny_model_small_pool(engine_assets, start_engine, caplog):
    """With the runtime's default limits the tiny model's pool is what they can occupy: 64 MiB."""
    caplog.set_level(logging.INFO, logger="loraserve.runtime.kv.budget")
    engine = start_engine(_unbudgeted_config(engine_assets.demo.model_dir))
    pool = engine.kv.capacity * engine.kv.bytes_per_token
    assert engine.kv.capacity == DEFAULT_ROWS * 1024
    assert pool < GIB
    assert any("KV cache budget on cpu" in r.getMessage() for r in caplog.records)


def test_long_context_takes_quarter(
    engine_assets, start_engine, caplog, tmp_path, monkeypatch
):
    """A real runner on a machine reporting 2 GiB available: the limits could occupy 2 GiB
    (128 rows x 32768 tokens x 512 bytes); the old rule took 0.85 of 2 GiB, now 512 MiB."""
    model_dir = build_tiny_model(
        tmp_path / "long", max_position_embeddings=32768, tokenizer_from=engine_assets.demo.model_dir
    )
    monkeypatch.setattr(budget, "available_memory_bytes", lambda device: 2 * GIB)
    caplog.set_level(logging.INFO, logger="loraserve.runtime.kv.budget")
    engine = start_engine(_unbudgeted_config(model_dir))
    assert engine.kv.bytes_per_token == TINY_BPT
    assert engine.kv.capacity == (GIB // 2) // TINY_BPT
    assert engine.kv.capacity * TINY_BPT <= GIB // 2
    messages = [r.getMessage() for r in caplog.records if "KV cache budget" in r.getMessage()]
    assert messages and "25% of 2.00 GiB available" in messages[-1]
