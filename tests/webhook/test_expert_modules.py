"""Router and expert target modules at admission: a LoRAServe of a mixture-of-experts family
may name its router (``gate``) and its experts as peft configs name them (Mixtral's w1 / w3 /
w2, the fused ``gate_up_proj``); a family without them is refused naming the module; an
Adapter's declared names are judged by the slots that serve them."""

from __future__ import annotations

import pytest

from loraserve.operator import webhooks

PIN = "0123456789abcdef0123456789abcdef01234567"
ARCH = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _serve(family: str, modules: list[str]) -> dict:
    return {
        "model": {"source": f"hf://acme/{family}@{PIN}", "architecture": ARCH[family]},
        "lora": {"targetModules": modules},
        "runtime": {"cudaGraph": {"enabled": False}},
    }


@pytest.mark.parametrize(
    "family,modules",
    [
        ("mixtral", ["q_proj", "v_proj", "gate", "w1", "w2", "w3"]),
        ("mixtral", ["q_proj", "gate_up_proj", "down_proj"]),
        ("qwen3_moe", ["q_proj", "gate", "gate_up_proj", "down_proj"]),
        ("qwen3_moe", ["q_proj", "gate_proj", "up_proj", "down_proj"]),
        ("llama", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ],
)
def test_family_modules_are_admitted(family, modules):
    verdict = webhooks.judge_serve(_serve(family, modules), name="s")
    assert verdict.allowed, verdict.problems


@pytest.mark.parametrize(
    "family,modules,absent",
    [("llama", ["q_proj", "gate"], "gate"), ("llama", ["w1"], "w1"), ("qwen3_moe", ["q_proj", "w2"], "w2")],
)
def test_modules_a_family_lacks_are_refused(family, modules, absent):
    verdict = webhooks.judge_serve(_serve(family, modules), name="s")
    assert not verdict.allowed
    problem = next(p for p in verdict.problems if "spec.lora.targetModules" in p)
    assert f"{absent}: {ARCH[family]} has no such module" in problem, problem


def test_adapter_names_are_judged_by_their_slots():
    """A Mixtral adapter declaring w1 / w3 / w2 and the router fits a serve wrapping the experts
    as gate_proj / up_proj / down_proj (the same slots); one on the attention does not."""
    serve = _serve("mixtral", ["gate_proj", "up_proj", "down_proj"])

    def judge(modules):
        spec = {"serve": "s", "source": f"hf://acme/a@{PIN}", "targetModules": modules}
        return webhooks.judge_adapter(spec, name="a", namespace="n", serve_spec=serve, siblings=[])

    assert judge(["w1", "w3", "w2", "gate"]).allowed
    refused = judge(["w1", "q_proj"])
    assert not refused.allowed and any("q_proj" in p for p in refused.problems), refused.problems
    assert not any("w1" in p for p in refused.problems), refused.problems
