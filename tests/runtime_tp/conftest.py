"""Tensor-parallel fixtures: tiny models and adapters, and a real 2-rank group over gloo.

The group is real: the pytest process is rank 0 (it drives), rank 1 is a worker process
started by the runtime's own launcher, and every collective goes over gloo on the CPU.
The oracle is always the same model, adapters and batches on one device.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.contract.config import DENSE_LORA_MODULES, LORA_MODULES, RuntimeConfig
from loraserve.runtime.dev.devmodels import (
    ALL_LINEAR_MODULES,
    build_adapter,
    build_draft_model,
    build_tiny_model,
)
from loraserve.runtime.executor.launch import TPHandle, TPOptions, start_tensor_parallel
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner


@pytest.fixture(autouse=True, scope="module")
def _fresh_tp_health() -> Iterator[None]:
    """A tensor-parallel group's health is process-wide: leave it as a new process has it, so
    a failure these tests provoke never makes a later module's server unready (xdist workers
    run modules of every directory in one process)."""
    yield
    from loraserve.runtime.distributed import health

    health.reset_health()


# Small timeouts: a broken test group fails in seconds, never hangs the suite.
TEST_OPTIONS = TPOptions(
    collective_timeout_s=60.0,
    control_timeout_s=30.0,
    heartbeat_s=1.0,
    startup_timeout_s=120.0,
    failure_grace_s=0.5,
)

GQA_ADAPTERS = {
    "attn-r8": {
        "rank": 8,
        "alpha": 16,
        "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "seed": 41,
    },
    "all-r16": {"rank": 16, "alpha": 32, "target_modules": ALL_LINEAR_MODULES, "seed": 42},
    "mlp-r4-rs": {
        "rank": 4,
        "alpha": 8,
        "target_modules": ("gate_proj", "up_proj", "down_proj"),
        "use_rslora": True,
        "seed": 43,
    },
    "emb-head": {"rank": 8, "alpha": 16, "target_modules": ("embed_tokens", "lm_head", "v_proj"), "seed": 44},
    "late-r4": {"rank": 4, "alpha": 4, "target_modules": ("o_proj", "down_proj", "up_proj"), "seed": 45},
}


@dataclass
class TPAssets:
    gqa: Path  # llama, 4 heads / 2 KV heads (split across 2 ranks), vocab 512, untied
    replicated: Path  # qwen2 (q/k/v biases), 1 KV head (replicated), vocab 509 (padded shard), tied
    biased: Path  # llama config with o/mlp biases, for random weights (config.json only)
    adapters: dict[str, Path]  # on gqa
    replicated_adapter: Path  # every module, embeddings and lm_head included, on replicated
    draft: Path  # a smaller model with gqa's tokenizer (STANDALONE)
    eagle: Path  # an EAGLE head for gqa


@pytest.fixture(scope="session")
def tp_assets(tmp_path_factory) -> TPAssets:
    from loraserve.runtime.speculative.eagle.builder import build_eagle_draft

    root = tmp_path_factory.mktemp("runtime_tp_assets")
    gqa = build_tiny_model(root / "gqa", num_layers=3, seed=51)
    replicated = build_tiny_model(
        root / "replicated",
        architecture="qwen2",
        num_kv_heads=1,
        vocab_size=509,
        tie_word_embeddings=True,
        seed=52,
    )
    biased = root / "biased"
    biased.mkdir()
    cfg = json.loads((gqa / "config.json").read_text())
    cfg.update(attention_bias=True, mlp_bias=True)
    (biased / "config.json").write_text(json.dumps(cfg))
    adapters = {name: build_adapter(root / "adapters" / name, gqa, **kw) for name, kw in GQA_ADAPTERS.items()}
    replicated_adapter = build_adapter(
        root / "adapters" / "rep-all", replicated, rank=8, alpha=8, target_modules=DENSE_LORA_MODULES, seed=53
    )
    return TPAssets(
        gqa=gqa,
        replicated=replicated,
        biased=biased,
        adapters=adapters,
        replicated_adapter=replicated_adapter,
        draft=build_draft_model(root / "draft", gqa, seed=54),
        eagle=build_eagle_draft(root / "eagle", gqa, version=1, seed=55, init_std=0.1),
    )


def tp_config(model: Path, tp: int, adapters: dict[str, Path] | None = None, **kw) -> RuntimeConfig:
    """A CPU configuration for ``model`` with ``adapters`` loaded at start-up."""
    config = RuntimeConfig()
    config.model.path = str(model)
    config.device = "cpu"
    config.parallel.tensor_parallel_size = tp
    config.scheduler.max_total_tokens = kw.pop("max_total_tokens", 4096)
    config.scheduler.max_running_requests = kw.pop("max_running_requests", 8)
    config.lora.max_rank = 16
    config.lora.max_loras_per_batch = kw.pop("max_loras_per_batch", 4)
    config.lora.max_loaded_loras = 8
    config.lora.target_modules = LORA_MODULES
    config.lora.backend = kw.pop("backend", "torch")
    config.lora.adapters = {name: str(path) for name, path in (adapters or {}).items()}
    config.attention_backend = kw.pop("attention", "sdpa")
    assert not kw, kw
    return config


@contextlib.contextmanager
def tp_group(
    config: RuntimeConfig, *, random_weights: bool = False
) -> Iterator[tuple[TPHandle, ModelRunner]]:
    """Start a real group for ``config`` (this process is rank 0); yields (handle, rank 0's runner)."""
    handle = start_tensor_parallel(
        config, options=TEST_OPTIONS, exit_on_failure=False, random_weights=random_weights
    )
    assert handle is not None
    try:
        runner = ModelRunner(config, random_weights=random_weights)
        yield handle, runner
        assert handle.health.failure is None, handle.health.failure
    finally:
        handle.shutdown()
    # A clean stop: every worker was told to exit and did, with status 0.
    assert [p.returncode for p in handle.workers] == [0] * len(handle.workers)


TOL = 1e-4  # fp32 on both sides; only the summation order of the all-reduce differs


@dataclass
class Pair:
    """The same model on two ranks (``tp``) and on one device (``ref``)."""

    tp: ModelRunner
    ref: ModelRunner
    handle: TPHandle

    def free(self, rids) -> None:
        """Free ``rids`` on both runners."""
        for rid in rids:
            self.tp.kv.free(rid)
            self.ref.kv.free(rid)


def both(pair, op, *args, **kw):
    """Run ``op`` on both runners; assert equal logits (and hidden states when returned)."""
    got, want = op(pair.tp, *args, **kw), op(pair.ref, *args, **kw)
    torch.testing.assert_close(got.logits, want.logits, atol=TOL, rtol=0)
    for name in ("hidden_states", "aux_hidden_states"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    return got


def extend(runner, rids, seqs, names=None, **kw):
    ids = torch.cat([torch.as_tensor(s, dtype=torch.int64) for s in seqs])
    batch = ForwardBatch(
        ForwardMode.EXTEND, list(rids), ids, extend_lens=[len(s) for s in seqs], lora_names=names, **kw
    )
    return runner.forward(batch)


def decode(runner, rids, tokens, names=None, **kw):
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    return runner.forward(ForwardBatch(ForwardMode.DECODE, list(rids), tokens, lora_names=names, **kw))


def verify(runner, rids, blocks, names=None, **kw):
    ids = torch.cat([torch.as_tensor(b, dtype=torch.int64) for b in blocks])
    batch = ForwardBatch(
        ForwardMode.TARGET_VERIFY, list(rids), ids, num_draft_tokens=len(blocks[0]), lora_names=names, **kw
    )
    return runner.forward(batch)


def every_mode(
    pair: Pair,
    names: list[str | None],
    lengths: tuple[int, ...],
    rejected: tuple[int, ...],
    *,
    vocab: int = 512,
    hidden_layers: tuple[int, ...] | None = None,
):
    """The sequence every two-rank oracle runs, each step held to one device by :func:`both`:
    an extend of one prompt of each of ``lengths`` (every position's logits, and the hidden
    states of ``hidden_layers`` when given), two decodes, a verify of 4 tokens per request,
    ``rejected`` tokens dropped per request (as the speculative decoder drops rejected
    drafts, so both caches must stay in step) and a decode after it; request ``i`` runs
    under ``names[i]`` (None: the base model). Tokens are drawn below ``vocab``. Both
    caches are freed and left with the same free tokens; returns the extend's output."""
    gen = torch.Generator().manual_seed(0)
    rids = [f"m{i}" for i in range(len(lengths))]
    hidden = {} if hidden_layers is None else {"return_hidden": True, "hidden_layers": hidden_layers}
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]
    out = both(pair, extend, rids, prompts, names, return_all_logits=True, **hidden)
    for _ in range(2):
        both(pair, decode, rids, torch.randint(3, vocab, (len(rids),), generator=gen), names)
    blocks = [torch.randint(3, vocab, (4,), generator=gen) for _ in rids]
    both(pair, verify, rids, blocks, names, return_hidden=hidden_layers is not None)
    for rid, dropped in zip(rids, rejected, strict=True):
        pair.tp.kv.truncate(rid, dropped)
        pair.ref.kv.truncate(rid, dropped)
    both(pair, decode, rids, torch.randint(3, vocab, (len(rids),), generator=gen), names)
    pair.free(rids)
    assert pair.tp.kv.num_free_tokens == pair.ref.kv.num_free_tokens
    return out


def greedy(runner, rid: str, prompt, adapter: str | None = None, n: int = 16) -> list[int]:
    """``n`` greedy tokens after ``prompt`` under ``adapter`` (the request freed after)."""
    seq = [int(extend(runner, [rid], [prompt], [adapter]).logits[0].argmax())]
    while len(seq) < n:
        seq.append(int(decode(runner, [rid], [seq[-1]], [adapter]).logits[0].argmax()))
    runner.kv.free(rid)
    return seq


def adapter_delta(runner, prompt, adapter: str) -> float:
    """The largest change ``adapter`` makes to ``prompt``'s extend logits."""
    base = extend(runner, ["delta-base"], [prompt]).logits
    runner.kv.free("delta-base")
    adapted = extend(runner, ["delta-lora"], [prompt], [adapter]).logits
    runner.kv.free("delta-lora")
    return float((adapted - base).abs().max())


@dataclass
class Finished:
    tokens: list[int]
    spec: object | None
    error: object | None


def run_engine(
    config: RuntimeConfig, runner, requests, *, timeout_s: float = 300.0
) -> tuple[dict[str, Finished], object]:
    """Serve ``requests`` (``(rid, prompt_ids, SamplingParams, adapter)``) through a real engine
    over ``runner``; returns every request's output and the engine (stopped)."""
    import threading

    from loraserve.runtime.engine.engine import Engine
    from loraserve.runtime.engine.request import Request
    from loraserve.runtime.speculative import build_decoder

    engine = Engine(config, runner, decoder_factory=build_decoder)
    outputs: dict[str, Finished] = {}
    collected: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    pending = set(collected)
    lock, done = threading.Lock(), threading.Event()

    def sink_for(rid):
        def sink(out):
            with lock:
                collected[rid].extend(out.token_ids)
                if out.finished:
                    outputs[rid] = Finished(collected[rid], out.spec, out.error)
                    pending.discard(rid)
                    if not pending:
                        done.set()

        return sink

    engine.start()
    try:
        for rid, prompt, params, adapter in requests:
            engine.submit(
                Request(rid=rid, prompt_ids=list(prompt), params=params, adapter=adapter, sink=sink_for(rid))
            )
        assert done.wait(timeout_s), f"requests still pending: {sorted(pending)}"
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    return outputs, engine
