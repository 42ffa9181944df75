"""Shared helpers for the speculative-decoding tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from loraserve.runtime.model.arch import ModelArchConfig
    from loraserve.runtime.speculative.eagle.runner import EagleDraftRunner


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; returns the p-value.

    Cells with expected count below 5 are pooled into one, as the test requires.
    """
    observed = observed.double().flatten()
    probs = expected_probs.double().flatten()
    probs = probs / probs.sum()
    n = observed.sum()
    expected = probs * n
    small = expected < 5
    if bool(small.any()):
        obs = torch.cat([observed[~small], observed[small].sum()[None]])
        exp = torch.cat([expected[~small], expected[small].sum()[None]])
    else:
        obs, exp = observed, expected
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):
        return 0.0  # something landed where the target puts no mass
    obs, exp = obs[keep], exp[keep]
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


@pytest.fixture
def chi_square():
    """``chi_square(observed_counts, expected_probs) -> p-value``."""
    return chi_square_pvalue


# --------------------------------------------------------------------------- models and engines

import json  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

ADAPTERS = {
    # name: build_adapter kwargs
    "attn-r8": {
        "rank": 8,
        "alpha": 16,
        "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "seed": 21,
    },
    "all-r16": {
        "rank": 16,
        "alpha": 32,
        "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "seed": 22,
    },
    "mlp-r4": {"rank": 4, "alpha": 8, "target_modules": ("gate_proj", "up_proj", "down_proj"), "seed": 23},
    "emb-head": {"rank": 8, "alpha": 16, "target_modules": ("embed_tokens", "lm_head", "v_proj"), "seed": 24},
}


@dataclass
class SpecAssets:
    target: Path
    adapters: dict[str, Path]
    small_draft: Path  # a different, smaller random model with the target's tokenizer
    same_draft: Path  # a copy of the target: every greedy draft is accepted
    eagle: Path
    eagle3: Path
    eagle3_d2t: Path  # an EAGLE3 draft with its own LM head over half the vocabulary (d2t)
    token_map: Path  # a third of the vocabulary, for an EAGLE draft over the target's head


@pytest.fixture(scope="session")
def spec_assets(tmp_path_factory) -> SpecAssets:
    from loraserve.runtime.dev.devmodels import build_adapter, build_draft_model, build_tiny_model, copy_model
    from loraserve.runtime.speculative.eagle.builder import build_eagle_draft

    root = tmp_path_factory.mktemp("spec_assets")
    target = build_tiny_model(root / "target", num_layers=3, seed=31)
    adapters = {name: build_adapter(root / "adapters" / name, target, **kw) for name, kw in ADAPTERS.items()}
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(35)).tolist()
    token_map = root / "token_map.json"
    token_map.write_text(json.dumps(order[: vocab // 3]))
    return SpecAssets(
        target=target,
        adapters=adapters,
        small_draft=build_draft_model(root / "small", target, seed=32),
        same_draft=copy_model(target, root / "same"),
        eagle=build_eagle_draft(root / "eagle", target, version=1, seed=33, init_std=0.1),
        eagle3=build_eagle_draft(
            root / "eagle3", target, version=3, aux_layer_ids=[1, 2, 3], seed=34, init_std=0.1
        ),
        eagle3_d2t=build_eagle_draft(
            root / "eagle3-d2t",
            target,
            version=3,
            aux_layer_ids=[1, 2, 3],
            seed=36,
            init_std=0.1,
            draft_vocab=sorted(order[: vocab // 2]),
        ),
        token_map=token_map,
    )


def tiny_target(assets: SpecAssets, device: str = "cpu") -> tuple[ModelArchConfig, torch.nn.Module]:
    """The tiny target's architecture and its float32 model on ``device`` (256 positions),
    for a draft runner built beside it: ``(arch, model)``."""
    from loraserve.runtime.model import build_model, load_arch_config

    arch = load_arch_config(assets.target)
    model = build_model(
        arch, dtype=torch.float32, device=torch.device(device), max_positions=256, model_dir=assets.target
    )
    return arch, model


def eagle_runner(
    path: Path, arch: ModelArchConfig, target: torch.nn.Module, device: str = "cpu", **kwargs
) -> EagleDraftRunner:
    """An EAGLE draft runner of ``path`` over ``target``'s embedding and LM head, float32 on
    ``device``, holding 1024 tokens of up to 8 requests of 256; ``kwargs`` go to its
    :class:`DraftSettings`."""
    from loraserve.runtime.speculative.draft.settings import DraftSettings
    from loraserve.runtime.speculative.eagle.runner import EagleDraftRunner

    sizes = {"max_total_tokens": 1024, "max_requests": 8, "max_context_len": 256}
    settings = DraftSettings(
        str(path),
        target_arch=arch,
        embed_weight=target.embed_tokens.weight,
        lm_head_weight=target.lm_head.weight,
        dtype=torch.float32,
        device=device,
        **{**sizes, **kwargs},
    )
    return EagleDraftRunner(settings)


def spec_config(
    assets: SpecAssets, algorithm: str = "NONE", draft: str | None = None, *, k: int = 4, **sched
):
    """A CPU RuntimeConfig for the tiny target with every test adapter loaded."""
    from loraserve.runtime.contract.config import LORA_MODULES, RuntimeConfig, SpecAlgorithm

    config = RuntimeConfig()
    config.model.path = str(assets.target)
    config.device = "cpu"
    config.scheduler.max_total_tokens = sched.pop("max_total_tokens", 8192)
    config.scheduler.max_running_requests = sched.pop("max_running_requests", 16)
    config.scheduler.chunked_prefill_size = sched.pop("chunked_prefill_size", 2048)
    config.model.context_length = sched.pop("context_length", None)
    assert not sched, sched
    config.lora.max_rank = 16
    config.lora.max_loras_per_batch = len(assets.adapters)
    config.lora.max_loaded_loras = len(assets.adapters)
    config.lora.target_modules = LORA_MODULES
    config.lora.backend = "torch"
    config.lora.adapters = {name: str(path) for name, path in assets.adapters.items()}
    config.speculative.algorithm = SpecAlgorithm(algorithm)
    if algorithm != "NONE":
        config.speculative.num_steps = k - 1
        config.speculative.num_draft_tokens = k
        paths = {
            "small": assets.small_draft,
            "same": assets.same_draft,
            "eagle": assets.eagle,
            "eagle3": assets.eagle3,
            "eagle3-d2t": assets.eagle3_d2t,
            "eagle-token-map": assets.eagle,
        }
        if draft is not None:
            config.speculative.draft_model_path = str(paths[draft])
        if draft == "eagle-token-map":
            config.speculative.token_map = str(assets.token_map)
    return config


@dataclass
class Finished:
    tokens: list[int]
    logprobs: list[float]
    spec: object | None
    reason: object | None
    error: object | None


@dataclass
class EngineRun:
    outputs: dict[str, Finished] = field(default_factory=dict)
    requests: dict[str, object] = field(default_factory=dict)  # rid -> the engine's Request
    engine: object | None = None


def run_engine(
    config, requests, *, timeout_s: float = 300.0, runner=None, decoder_hook=None, tokenizer=None
) -> EngineRun:
    """Run ``requests`` (``(rid, prompt_ids, SamplingParams, adapter)``) through a real engine.

    Requests are submitted back to back; the scheduler batches them up to
    ``scheduler.max_running_requests``. Returns every request's final tokens. ``tokenizer``:
    the engine's (structured output and stop strings need one).
    """
    from loraserve.runtime.engine.engine import Engine
    from loraserve.runtime.engine.request import Request
    from loraserve.runtime.runner.model_runner import ModelRunner
    from loraserve.runtime.speculative import build_decoder

    runner = runner or ModelRunner(config)
    engine = Engine(config, runner, tokenizer=tokenizer, decoder_factory=build_decoder)
    engine.refresh_adapters()
    if decoder_hook is not None:
        decoder_hook(engine.decoder)
    run = EngineRun(engine=engine)
    done = threading.Event()
    pending = {rid for rid, *_ in requests}
    collected: dict[str, list[int]] = {rid: [] for rid in pending}
    logprobs: dict[str, list[float]] = {rid: [] for rid in pending}
    lock = threading.Lock()

    def sink_for(rid):
        def sink(out):
            with lock:
                collected[rid].extend(out.token_ids)
                logprobs[rid].extend(out.logprobs or [])
                if out.finished:
                    run.outputs[rid] = Finished(
                        collected[rid], logprobs[rid], out.spec, out.finish_reason, out.error
                    )
                    pending.discard(rid)
                    if not pending:
                        done.set()

        return sink

    engine.start()
    try:
        for rid, prompt, params, adapter in requests:
            req = Request(
                rid=rid, prompt_ids=list(prompt), params=params, adapter=adapter, sink=sink_for(rid)
            )
            run.requests[rid] = req
            engine.submit(req)
        assert done.wait(timeout_s), f"requests still pending: {sorted(pending)}"
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    return run


@pytest.fixture(scope="session")
def make_spec_config(spec_assets):
    """``make_spec_config(algorithm="NONE", draft=None, *, k=4, **scheduler)`` for the tiny target."""

    def make(algorithm: str = "NONE", draft: str | None = None, **kw):
        return spec_config(spec_assets, algorithm, draft, **kw)

    return make


@pytest.fixture(scope="session")
def engine_run():
    """``engine_run(config, requests, ...) -> EngineRun`` (see :func:`run_engine`)."""
    return run_engine


@pytest.fixture(scope="session")
def adapter_names() -> tuple[str, ...]:
    return tuple(ADAPTERS)
