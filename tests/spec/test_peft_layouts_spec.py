"""Adapters in the layouts peft writes by default stay lossless under speculation.

peft's default ``save_embedding_layers="auto"`` saves whole base ``embed_tokens`` /
``lm_head`` copies beside an adapter of those modules; the runtime checks and drops them.
Through the real engine, greedy output with speculation (NGRAM, STANDALONE, EAGLE3) equals
the output without, per adapter, for adapters saved by peft itself with each setting, on
an untied and a tied-embedding target. Under an EAGLE-family draft such an adapter still
gets the policy's accept-rate warning (the draft uses the base embeddings).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from loraserve.runtime.sampling import SamplingParams

from .conftest import spec_config

EMB_HEAD = ("embed_tokens", "lm_head", "v_proj")

LAYOUTS = {
    # name: (target, save_pretrained's save_embedding_layers ("auto": not passed), LoraConfig kwargs)
    "emb-head-auto": ("untied", "auto", {"target_modules": EMB_HEAD}),
    "emb-head-true": ("untied", True, {"target_modules": EMB_HEAD}),
    "emb-head-false": ("untied", False, {"target_modules": EMB_HEAD}),
    "rslora-all-auto": (
        "untied",
        "auto",
        {
            "target_modules": (
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "embed_tokens",
                "lm_head",
            ),
            "use_rslora": True,
            "r": 4,
            "lora_alpha": 8,
        },
    ),
    "tied-emb-head-auto": ("tied", "auto", {"target_modules": ("embed_tokens", "lm_head", "q_proj")}),
}


def _save_peft_adapter(dest: Path, base_dir: Path, save_embedding_layers, seed: int, **lora) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model.requires_grad_(False)
    lora = {"r": 8, "lora_alpha": 16, **lora}
    lora["target_modules"] = list(lora["target_modules"])
    config = LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(peft_model.named_parameters()):
                if ".lora_" in name:  # peft starts B at zero: random weights make the adapter matter
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        kwargs = {} if save_embedding_layers == "auto" else {"save_embedding_layers": save_embedding_layers}
        peft_model.save_pretrained(str(dest), safe_serialization=True, **kwargs)
    return dest


@pytest.fixture(scope="module")
def peft_targets(spec_assets, tmp_path_factory):
    """{"untied": (assets, adapters), "tied": (assets, adapters)}: a SpecAssets copy per target
    whose adapters are the peft-saved layouts."""
    from dataclasses import replace

    from loraserve.runtime.dev.devmodels import build_draft_model, build_tiny_model

    root = tmp_path_factory.mktemp("peft_spec")
    tied = build_tiny_model(root / "tied", num_layers=3, seed=61, tie_word_embeddings=True)
    targets = {
        "untied": replace(spec_assets, adapters={}),
        "tied": replace(
            spec_assets,
            target=tied,
            adapters={},
            small_draft=build_draft_model(root / "tied-small", tied, seed=62),
        ),
    }
    for i, (name, (which, setting, lora)) in enumerate(LAYOUTS.items()):
        target = targets[which]
        target.adapters[name] = _save_peft_adapter(root / name, target.target, setting, seed=70 + i, **lora)
    return targets


def _requests(adapters, seed: int = 3, count: int = 12, max_tokens: int = 16):
    gen = torch.Generator().manual_seed(seed)
    names = [None, *sorted(adapters)]
    out = []
    for i in range(count):
        n = int(torch.randint(3, 30, (1,), generator=gen))
        if i % 3 == 0:
            unit = torch.randint(3, 500, (3,), generator=gen)
            prompt = unit.repeat(n // 3 + 1)[:n].tolist()
        else:
            prompt = torch.randint(3, 500, (n,), generator=gen).tolist()
        out.append(
            (f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), names[i % len(names)])
        )
    return out


CASES = {
    "untied-ngram": ("untied", "NGRAM", None),
    "untied-standalone": ("untied", "STANDALONE", "small"),
    "untied-eagle3": ("untied", "EAGLE3", "eagle3"),
    "tied-ngram": ("tied", "NGRAM", None),
    "tied-standalone": ("tied", "STANDALONE", "small"),
}


@pytest.fixture(scope="module")
def baselines(peft_targets, engine_run):
    out = {}
    for which, assets in peft_targets.items():
        requests = _requests(assets.adapters)
        run = engine_run(spec_config(assets), requests)
        tokens = {}
        for rid, *_ in requests:
            assert run.outputs[rid].error is None, (rid, run.outputs[rid].error)
            tokens[rid] = run.outputs[rid].tokens
        out[which] = (requests, tokens)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_layouts_greedy_spec_equals_no_spec(case, peft_targets, baselines, engine_run):
    which, algorithm, draft = CASES[case]
    assets = peft_targets[which]
    requests, expected = baselines[which]
    run = engine_run(spec_config(assets, algorithm, draft), requests)
    for rid, _, params, adapter in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[rid], f"{rid} (adapter {adapter}) diverged under {case}"
        assert len(out.tokens) == params.max_tokens
        assert out.spec is not None and out.spec.verify_steps >= 1
    snap = run.engine.decoder.metrics.snapshot()
    assert set(snap.per_adapter) == {"", *assets.adapters}


def test_every_adapter_changes_the_output(peft_targets, engine_run):
    """Else spec-on = spec-off per adapter would prove little: each peft adapter changes the
    greedy tokens of one prompt against the base."""
    for which, assets in peft_targets.items():
        prompt = list(range(5, 17))
        names = [None, *assets.adapters]
        reqs = [(f"p-{a}", prompt, SamplingParams(max_tokens=12, temperature=0.0), a) for a in names]
        run = engine_run(spec_config(assets), reqs)
        base = run.outputs["p-None"].tokens
        for adapter in assets.adapters:
            assert run.outputs[f"p-{adapter}"].tokens != base, (which, adapter)


def test_eagle_warns_peft_embeddings(peft_targets):
    """The copies are dropped, not the modules: the loaded adapter still declares
    embed_tokens / lm_head, so the admin API's policy check warns under EAGLE3."""
    from loraserve.runtime.contract.policy import AdapterDeclaration, check_adapter
    from loraserve.runtime.runner.model_runner import ModelRunner

    assets = peft_targets["untied"]
    config = spec_config(assets, "EAGLE3", "eagle3")
    runner = ModelRunner(config)
    for name in assets.adapters:
        info = runner.lora.load(name, assets.adapters[name])
        report = check_adapter(
            config, AdapterDeclaration(name=name, target_modules=tuple(info.target_modules))
        )
        assert "embed_tokens" in info.target_modules and "lm_head" in info.target_modules
        assert "adapter-eagle-embeddings" in report.warning_rules(), name
