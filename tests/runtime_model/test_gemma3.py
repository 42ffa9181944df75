"""Gemma 3 (text) against transformers (+ peft) in float32 on tiny configs built from
transformers' own ``Gemma3TextConfig``: extend, decode and verify rows over prompts longer
than the sliding window, sliding and global layers alternating with different rope bases,
``(1 + w)`` norms (random weights), the embedding scale and ``query_pre_attn_scalar``; a
final logit cap; adapters on every linear module; greedy spec-on = spec-off with NGRAM."""

from __future__ import annotations

import json

import pytest
import torch

from loraserve.runtime.contract.config import LORA_MODULES, RuntimeConfig, SpecAlgorithm
from loraserve.runtime.dev.devmodels import ALL_LINEAR_MODULES, build_adapter, build_tiny_model
from loraserve.runtime.model import ModelConfigError, load_arch_config
from loraserve.runtime.sampling import SamplingParams

from .test_model_parity import _check_modes

SMALL = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,  # the global layers' base; the sliding layers rotate at 10000
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    # query_pre_attn_scalar differs from head_dim, so the score scale is Gemma's own
    # (build_tiny_model passes Gemma's extra fields through its ``moe`` argument).
    model = build_tiny_model(root / "m", architecture="gemma3", seed=81, moe={"query_pre_attn_scalar": 24}, **SMALL)
    capped = build_tiny_model(
        root / "capped",
        architecture="gemma3",
        seed=82,
        moe={"query_pre_attn_scalar": 24, "final_logit_softcapping": 2.0},
        **SMALL,
    )
    adapter = build_adapter(root / "a", model, rank=8, alpha=16, target_modules=ALL_LINEAR_MODULES, seed=83)
    return {"model": model, "capped": capped, "adapter": adapter}


def test_config_is_read(gemma):
    arch = load_arch_config(gemma["model"])
    assert arch.family == "gemma3" and arch.qk_norm and arch.tie_word_embeddings
    assert arch.gemma.sliding_layers == (True, False, True, False) and arch.gemma.sliding_window == 4
    assert arch.gemma.local_rope_theta == 10000.0 and arch.rope.theta == 1e6
    assert arch.gemma.query_pre_attn_scalar == 24 and arch.gemma.final_logit_softcap is None
    assert load_arch_config(gemma["capped"]).gemma.final_logit_softcap == 2.0


@pytest.mark.parametrize("which", ["model", "capped"])
def test_base_logits_match_transformers(which, gemma, make_runner, hf_model, ops):
    runner = make_runner(gemma[which])
    with torch.no_grad():
        _check_modes(runner, hf_model(gemma[which]), ops, seed=3)


def test_paged_attention_sliding_window(gemma, hf_model, ops):
    """The Triton paged kernel (decode and verify rows) takes each sliding layer's window."""
    from loraserve.runtime.runner.model_runner import ModelRunner

    from .conftest import runtime_config

    config = runtime_config(gemma["model"])
    config.attention_backend = "triton"
    runner = ModelRunner(config)
    with torch.no_grad():
        _check_modes(runner, hf_model(gemma["model"]), ops, seed=5)


def test_adapter_logits_match_peft(gemma, make_runner, hf_model, ops):
    runner = make_runner(gemma["model"], adapters={"a": gemma["adapter"]})
    with torch.no_grad():
        _check_modes(runner, hf_model(gemma["model"], gemma["adapter"]), ops, names=["a", "a"], seed=4)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
    ],
)
def test_unserved_configs_are_refused(gemma, tmp_path, change, words):
    import shutil

    shutil.copytree(gemma["model"], tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ModelConfigError, match=words):
        load_arch_config(tmp_path / "m")


def test_ngram_speculation_is_lossless(gemma, tmp_path):
    from tests.spec.conftest import run_engine

    def config(algorithm: str) -> RuntimeConfig:
        c = RuntimeConfig()
        c.model.path = str(gemma["model"])
        c.device = "cpu"
        c.scheduler.max_total_tokens = 2048
        c.lora.max_rank = 8
        c.lora.target_modules = LORA_MODULES
        c.lora.backend = "torch"
        c.lora.adapters = {"a": str(gemma["adapter"])}
        c.speculative.algorithm = SpecAlgorithm(algorithm)
        if algorithm != "NONE":
            c.speculative.num_steps, c.speculative.num_draft_tokens = 3, 4
        return c

    gen = torch.Generator().manual_seed(6)
    requests = []
    for i in range(4):
        unit = torch.randint(3, 500, (3,), generator=gen)
        prompt = unit.repeat(6)[: 10 + i].tolist()  # repeats: n-gram drafts get accepted
        requests.append((f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0), "a" if i % 2 else None))
    base = run_engine(config("NONE"), requests)
    spec = run_engine(config("NGRAM"), requests)
    for rid, *_ in requests:
        assert spec.outputs[rid].error is None, spec.outputs[rid].error
        assert spec.outputs[rid].tokens == base.outputs[rid].tokens, rid
    assert sum(spec.outputs[rid].spec.accepted_tokens for rid, *_ in requests) > 0


def test_policy_serves_gemma3_sharded():
    """Gemma 3 is admitted on one device and on two tensor-parallel ranks (its layers are
    cut as the Llama family's are: tests/runtime_tp/test_gemma3_tp.py)."""
    from loraserve.runtime.contract.policy import check_config

    config = RuntimeConfig()
    config.model.path = "/models/gemma-3"
    config.model.architecture = "Gemma3ForCausalLM"
    config.cuda_graph.enabled = False
    for size in (1, 2):
        config.parallel.tensor_parallel_size = size
        violations = check_config(config).violations
        assert not violations, [str(v) for v in violations]


def test_graphs_equal_eager(gemma, ops):
    """CUDA graphs replay the sliding layers' windows as the eager path computes them, padded
    requests included: on a GPU with real captures (the paged kernel's windows), on the CPU
    the graph runner's static padded path run eagerly (everything but the capture)."""
    from loraserve.runtime.runner.cuda_graph import CudaGraphRunner
    from loraserve.runtime.runner.model_runner import ModelRunner

    from .conftest import runtime_config

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def runner() -> ModelRunner:
        config = runtime_config(gemma["model"])
        config.device = device
        r = ModelRunner(config)
        r.lora.load("a", gemma["adapter"])
        return r

    eager, graphed = runner(), runner()
    graphed.graphs = CudaGraphRunner(graphed, use_graphs=device == "cuda", max_bs=4)
    gen = torch.Generator().manual_seed(8)
    rids, names = ["x", "y", "z"], ["a", None, "a"]  # 3 requests: padded to 4
    prompts = [torch.randint(3, 500, (n,), generator=gen) for n in (9, 3, 13)]
    with torch.no_grad():
        for r in (eager, graphed):
            ops.extend(r, rids, prompts, names=names)
        for _ in range(3):
            tok = torch.randint(3, 500, (3,), generator=gen)
            want, got = ops.decode(eager, rids, tok, names=names), ops.decode(graphed, rids, tok, names=names)
            torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=0)
        blocks = [torch.randint(3, 500, (3,), generator=gen) for _ in rids]
        want, got = ops.verify(eager, rids, blocks, names=names), ops.verify(graphed, rids, blocks, names=names)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=0)
