"""Model families: which architectures the runtime serves, and what their mixture-of-experts
members cannot run beside.

The table is the one source for the runtime's model code (``runtime.model.arch`` reads
it) and for this policy. The MoE layers run on the torch path on the CPU and on the fused
Triton path on CUDA, whose shapes depend only on the token rows (its routing buffers are
sized for a graph's tokens); CUDA graphs stay refused on MoE models until their capture
is proven on a GPU. Under tensor parallelism every expert is cut along its intermediate
dimension over the ranks (router whole, one all-reduce per layer), as vLLM and SGLang cut
them; the start-up refuses a size that does not divide it. Speculation on MoE
targets is verified lossless (spec-on = spec-off per adapter) for the algorithms in
:data:`MOE_SPEC_ALGORITHMS`.
"""

from __future__ import annotations

from ..algorithms import ALGORITHMS
from ..config import DENSE_LORA_MODULES, LORA_MODULES, RuntimeConfig, SpecAlgorithm
from .findings import Kind, Violation

ARCHITECTURE_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
"""config.json ``architectures[0]`` -> the family the runtime's layers implement."""

MOE_FAMILIES: tuple[str, ...] = ("qwen3_moe", "qwen2_moe", "mixtral")
"""Families whose MLP is (in some layers) a sparse mixture of experts."""

MOE_SPEC_ALGORITHMS: tuple[SpecAlgorithm, ...] = tuple(a for a, t in ALGORITHMS.items() if t.moe_target)
"""Speculative algorithms served on an MoE target (``AlgorithmTraits.moe_target``: each reads only the target's logits and
hidden states, which the MoE layers produce as a dense layer does)."""


FAMILY_LORA_MODULES: dict[str, tuple[str, ...]] = {
    "qwen3_moe": (*DENSE_LORA_MODULES, "gate", "gate_up_proj"),
    "qwen2_moe": (*DENSE_LORA_MODULES, "gate", "gate_up_proj", "shared_expert_gate"),
    "mixtral": (*DENSE_LORA_MODULES, "gate", "gate_up_proj", "w1", "w2", "w3"),
    "phi3": (*DENSE_LORA_MODULES, "qkv_proj", "gate_up_proj"),
}
"""The ``lora.target_modules`` names each family has (others: :data:`DENSE_LORA_MODULES`). The
experts of Qwen3-MoE are named gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2 (or those);
both have a router (``gate``) and, saved by peft with transformers 5, a fused ``gate_up_proj``.
Qwen2-MoE's are Qwen3-MoE's plus a shared expert (gate_proj / up_proj / down_proj: peft's
``target_modules`` reach these, ``target_parameters`` the routed experts) and its
``shared_expert_gate``.
Phi-3's checkpoints fuse q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``): its adapters name
those, served by the q/k/v and gate/up slots (the dense names are its slots, so they stay valid)."""


def family_modules(architecture: str) -> tuple[str, ...]:
    """The module names a model of ``architecture`` (a served one) has."""
    return FAMILY_LORA_MODULES.get(ARCHITECTURE_FAMILIES[architecture], DENSE_LORA_MODULES)


def is_moe(architecture: str | None) -> bool:
    """Whether ``architecture`` (config.json's) is a mixture-of-experts family."""
    return ARCHITECTURE_FAMILIES.get(architecture or "") in MOE_FAMILIES


def model_family(config: RuntimeConfig) -> list[Violation]:
    """The target's architecture (when known: the runtime reads it from config.json at
    start-up; a LoRAServe may state it), and what an MoE target cannot run beside."""
    out = _moe_draft(config)
    architecture = config.model.architecture
    if not architecture:
        return out
    if architecture not in ARCHITECTURE_FAMILIES:
        unknown = Violation(
            "model-architecture",
            "model.architecture",
            f"{architecture} is not a model family this runtime serves",
            f"serve a model of one of {', '.join(ARCHITECTURE_FAMILIES)}",
            kind=Kind.UNAVAILABLE,
            related=("model.path",),
        )
        return [*out, unknown]
    out += _family_modules(config, architecture)
    if not is_moe(architecture):
        return out
    if config.cuda_graph.enabled:
        out.append(
            Violation(
                "moe-cuda-graph",
                "cuda_graph.enabled",
                f"CUDA graphs are not served with the mixture-of-experts layers of {architecture} yet: their "
                "fused path is built for capture, but capturing it is not enabled",
                "set {cuda_graph.enabled} to false",
                kind=Kind.UNAVAILABLE,
                related=("model.architecture",),
            )
        )
    algorithm = SpecAlgorithm(config.speculative.algorithm)
    if algorithm not in MOE_SPEC_ALGORITHMS:
        served = ", ".join(a.value for a in MOE_SPEC_ALGORITHMS)
        out.append(
            Violation(
                "moe-speculative",
                "speculative.algorithm",
                f"{algorithm.value} is not served on a mixture-of-experts target such as {architecture}",
                f"set {{speculative.algorithm}} to one of {served}",
                kind=Kind.UNAVAILABLE,
                related=("model.architecture",),
            )
        )
    return out


def _moe_draft(config: RuntimeConfig) -> list[Violation]:
    """A mixture-of-experts draft model (STANDALONE) runs the same torch MoE path: no CUDA graphs."""
    draft = config.speculative.draft_model_architecture
    if not (config.speculative.enabled and is_moe(draft) and config.cuda_graph.enabled):
        return []
    return [
        Violation(
            "moe-draft-cuda-graph",
            "cuda_graph.enabled",
            f"the draft {draft} has mixture-of-experts layers, which run on the torch path that no CUDA graph "
            "can capture",
            "set {cuda_graph.enabled} to false, or use a dense draft model",
            kind=Kind.UNAVAILABLE,
            related=("speculative.draft_model_architecture",),
        )
    ]


def _family_modules(config: RuntimeConfig, architecture: str) -> list[Violation]:
    """Target modules the family does not have (a router or experts on a dense model). Every
    name at once (``--lora-target-modules all``) means every module the family has."""
    named = tuple(config.lora.target_modules)
    if not config.lora.enabled or set(named) >= set(LORA_MODULES):
        return []
    has = family_modules(architecture)
    absent = [m for m in dict.fromkeys(named) if m in LORA_MODULES and m not in has]
    if not absent:
        return []
    return [
        Violation(
            "lora-modules-family",
            "lora.target_modules",
            f"{', '.join(absent)}: {architecture} has no such module (its adapters may target {', '.join(has)})",
            f"remove {', '.join(absent)} from {{lora.target_modules}}",
            related=("model.architecture",),
        )
    ]
