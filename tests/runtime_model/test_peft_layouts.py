"""Adapter files exactly as peft writes them by default, served against transformers + peft.

Every adapter here is made by ``get_peft_model`` + ``save_pretrained`` (LoRA weights set to
random values: peft starts B at zero), for each ``save_embedding_layers`` setting. peft's
default ("auto") saves the whole base ``embed_tokens`` / ``lm_head`` weight beside an
adapter of those modules (``...embed_tokens.base_layer.weight``); the runtime checks each
such copy against the served model's whole weight and drops it when equal, and refuses the
adapter, naming the tensor and the fix, when it differs (a resized or retrained
vocabulary). ``modules_to_save`` (a trained full copy of a module) is refused naming it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.runtime.contract.config import LORA_MODULES
from loraserve.runtime.dev.devmodels import ALL_LINEAR_MODULES
from loraserve.runtime.lora import AdapterError, AdapterState

EMB_HEAD = ("embed_tokens", "lm_head", "v_proj")
EMBED_COPY = "base_model.model.model.embed_tokens.base_layer.weight"
HEAD_COPY = "base_model.model.lm_head.base_layer.weight"


def save_peft_adapter(
    dest: Path,
    base_dir: Path,
    *,
    target_modules=EMB_HEAD,
    save_embedding_layers: bool | str = "auto",
    rank: int = 8,
    alpha: float = 16,
    use_rslora: bool = False,
    modules_to_save=None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    resize_vocab_to: int | None = None,
    init_std: float = 0.05,
    ensure_weight_tying: bool = False,
    layers_to_transform: list[int] | None = None,
) -> Path:
    """``get_peft_model`` on the transformers model + random LoRA weights + ``save_pretrained``.
    ``save_embedding_layers="auto"`` calls save_pretrained without the argument (peft's default)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
    if resize_vocab_to is not None:
        model.resize_token_embeddings(resize_vocab_to)
    model.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        use_rslora=use_rslora,
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        ensure_weight_tying=ensure_weight_tying,
        layers_to_transform=layers_to_transform,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tied lm_head/embed_tokens adapted separately; deprecations
        peft_model = get_peft_model(model, config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(peft_model.named_parameters()):
                if ".lora_" in name:
                    param.copy_((torch.randn(param.shape, generator=generator) * init_std).to(param.dtype))
                elif ".modules_to_save." in name:  # a trained copy: differs from the base
                    param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.1)
        kwargs = {} if save_embedding_layers == "auto" else {"save_embedding_layers": save_embedding_layers}
        peft_model.save_pretrained(str(dest), safe_serialization=True, **kwargs)
    return dest


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


# name: (model kind, save_peft_adapter kwargs, full copies peft must have written)
ACCEPTED = {
    "emb-head-auto": ("llama-gqa", {"seed": 40}, {EMBED_COPY, HEAD_COPY}),
    "emb-head-true": ("llama-gqa", {"save_embedding_layers": True, "seed": 41}, {EMBED_COPY, HEAD_COPY}),
    "emb-head-false": ("llama-gqa", {"save_embedding_layers": False, "seed": 42}, set()),
    "tied-emb-head-auto": (
        "llama-tied-mha",
        {"target_modules": ("embed_tokens", "lm_head", "q_proj"), "seed": 43},
        {EMBED_COPY, HEAD_COPY},
    ),
    "head-only-auto": ("llama-gqa", {"target_modules": ("lm_head",), "seed": 44}, {HEAD_COPY}),
    "rslora-all-auto": (
        "llama-gqa",
        {
            "target_modules": (*ALL_LINEAR_MODULES, "embed_tokens", "lm_head"),
            "use_rslora": True,
            "rank": 4,
            "alpha": 8,
            "seed": 45,
        },
        {EMBED_COPY, HEAD_COPY},
    ),
    # peft ties the lm_head adapter to embed_tokens' and declares only embed_tokens
    "tied-ensure-tying-auto": (
        "llama-tied-mha",
        {"target_modules": ("embed_tokens", "q_proj"), "ensure_weight_tying": True, "seed": 49},
        {EMBED_COPY, HEAD_COPY},
    ),
    # save_embedding_layers=True without embedding targets: plain-named full copies
    "attn-true": (
        "llama-gqa",
        {"target_modules": ("q_proj", "v_proj"), "save_embedding_layers": True, "seed": 46},
        {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"},
    ),
    # a pattern string, and LoRA on one layer only (the other layer's slot stays zero)
    "all-linear-auto": ("llama-gqa", {"target_modules": "all-linear", "seed": 53}, set()),
    "layer-1-only": (
        "llama-gqa",
        {"target_modules": ("q_proj", "down_proj"), "layers_to_transform": [1], "seed": 54},
        set(),
    ),
    "attn-auto": ("llama-gqa", {"target_modules": ("q_proj", "v_proj"), "seed": 47}, set()),
    # trained in bfloat16: the copies are bf16 roundings of the float32 base, equal in bf16
    "emb-head-bf16-auto": ("llama-gqa", {"dtype": torch.bfloat16, "seed": 48}, {EMBED_COPY, HEAD_COPY}),
}


@pytest.fixture(scope="module")
def layouts(assets, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (model dir, adapter dir), every adapter saved by peft."""
    root = tmp_path_factory.mktemp("peft_layouts")
    out = {}
    for name, (kind, kwargs, _) in ACCEPTED.items():
        model_dir = assets.models[kind]
        out[name] = (model_dir, save_peft_adapter(root / name, model_dir, **kwargs))
    return out


def _without_copies(src: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(src, dest)
    tensors = {k: v for k, v in _tensors(dest).items() if ".lora_" in k}
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    return dest


def _copies(path: Path) -> set[str]:
    return {k for k in _tensors(path) if ".lora_" not in k}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_peft_layout_is_served_like_peft(name, layouts, make_runner, hf_model, ops, tmp_path):
    from .test_model_parity import _check_modes

    model_dir, adapter_dir = layouts[name]
    # the file is the layout under test (peft's own choice of full copies)
    assert _copies(adapter_dir) == ACCEPTED[name][2]
    runner = make_runner(model_dir, adapters={name: adapter_dir})
    info = runner.lora.get(name)
    assert info.state is AdapterState.LOADED
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    declared = {m.rsplit(".", 1)[-1] for m in cfg["target_modules"]}
    if cfg.get("ensure_weight_tying"):
        declared |= {"embed_tokens", "lm_head"}
    assert set(info.target_modules) == declared
    # the copies are dropped: only LoRA weights are held
    lora_bytes = sum(v.numel() * 4 for k, v in _tensors(adapter_dir).items() if ".lora_" in k)
    assert runner.lora._entries[name].weights.num_bytes == lora_bytes
    if cfg.get("use_rslora"):
        assert info.scaling == pytest.approx(cfg["lora_alpha"] / cfg["r"] ** 0.5)
    reference = hf_model(model_dir, adapter_dir)
    if name == "emb-head-bf16-auto":
        # peft itself would overwrite the float32 base embedding with the saved bf16 rounding;
        # the runtime keeps the served (float32) weight it checked the copy against, which is
        # peft on the same file without the copies. peft with the copies stays within bf16 noise.
        stripped = _without_copies(adapter_dir, tmp_path / "stripped")
        with torch.no_grad():
            prompt = torch.arange(3, 14)[None]
            noise = (reference(prompt).logits - hf_model(model_dir, stripped)(prompt).logits).abs().max()
        assert 0 < noise < 2e-2
        reference = hf_model(model_dir, stripped)
    with torch.no_grad():
        _check_modes(runner, reference, ops, names=[name, name], seed=2)
        prompt = torch.arange(3, 14)[None]
        effect = (reference(prompt).logits - hf_model(model_dir)(prompt).logits).abs().max()
        assert effect > 1e-2, "the adapter must change the output for the comparison to mean anything"


@pytest.mark.parametrize("name", ["emb-head-auto", "tied-emb-head-auto", "rslora-all-auto"])
def test_greedy_tokens_equal_transformers_peft(name, layouts, make_runner, hf_model, ops):
    model_dir, adapter_dir = layouts[name]
    runner = make_runner(model_dir, adapters={name: adapter_dir})
    reference = hf_model(model_dir, adapter_dir)
    prompt = torch.tensor([1, 306, 395, 347, 486, 10, 308, 334])
    with torch.no_grad():
        expected = reference.generate(
            input_ids=prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        base = (
            hf_model(model_dir)
            .generate(
                input_ids=prompt[None],
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :]
            .tolist()
        )
    assert expected != base, "the adapter must change the greedy output"
    out = ops.extend(runner, ["g"], [prompt], names=[name])
    tokens = [int(out.logits[0].argmax())]
    while len(tokens) < 24:
        out = ops.decode(runner, ["g"], [tokens[-1]], names=[name])
        tokens.append(int(out.logits[0].argmax()))
    assert tokens == expected


# ------------------------------------------------------------------------------------ refusals


def _refused(runner, name: str, path: Path) -> AdapterError:
    listing = runner.lora.list()
    with pytest.raises(AdapterError) as err:
        runner.lora.load(name, path)
    assert runner.lora.list() == listing
    assert err.value.adapter == name
    return err.value


def _perturb(src: Path, dest: Path, tensor: str, delta: float = 1e-3) -> Path:
    import shutil

    shutil.copytree(src, dest)
    tensors = _tensors(dest)
    tensors[tensor] = tensors[tensor].clone()
    tensors[tensor][7, 3] += delta  # one value of the whole copy
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    return dest


@pytest.mark.parametrize(
    ("layout", "tensor"),
    [
        ("emb-head-auto", EMBED_COPY),
        ("emb-head-auto", HEAD_COPY),
        ("tied-emb-head-auto", HEAD_COPY),  # tied: the lm_head copy is checked against the embedding
        ("attn-true", "base_model.model.model.embed_tokens.weight"),
    ],
)
def test_retrained_embedding_refused(
    layout, tensor, layouts, make_runner, tmp_path
):
    """A retrained embedding copy is refused naming tensor and fix."""
    model_dir, adapter_dir = layouts[layout]
    bad = _perturb(adapter_dir, tmp_path / "retrained", tensor)
    runner = make_runner(model_dir)
    err = _refused(runner, "retrained", bad)
    message = str(err)
    assert err.field == tensor
    assert repr(tensor) in message and "1 of" in message and "differ from the served model's" in message
    assert "serve the model holding those" in message and "save_embedding_layers=False" in message
    # the untouched file loads on the same runner
    assert runner.lora.load("fine", adapter_dir).state is AdapterState.LOADED


def test_resized_vocab_refused(assets, make_runner, tmp_path):
    """A resized vocabulary is refused naming tensor and fix."""
    model_dir = assets.models["llama-gqa"]
    resized = save_peft_adapter(tmp_path / "resized", model_dir, resize_vocab_to=520, seed=50)
    assert _tensors(resized)[EMBED_COPY].shape[0] == 520
    err = _refused(make_runner(model_dir), "resized", resized)
    assert err.field in (EMBED_COPY, HEAD_COPY)
    assert "resized vocabulary" in str(err) and "(512, 64)" in str(err) and "(520, 64)" in str(err)
    assert "as the base" in str(err)


@pytest.mark.parametrize("save_embedding_layers", ["auto", True, False])
@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
def test_modules_to_save_refused(
    module, save_embedding_layers, assets, make_runner, tmp_path
):
    """Modules to save is refused naming the module."""
    model_dir = assets.models["llama-gqa"]
    path = save_peft_adapter(
        tmp_path / "mts",
        model_dir,
        target_modules=("q_proj", "v_proj"),
        modules_to_save=[module],
        save_embedding_layers=save_embedding_layers,
        seed=51,
    )
    err = _refused(make_runner(model_dir), "mts", path)
    assert err.field == "modules_to_save"
    assert f"modules_to_save=['{module}']" in str(err) and f"full copy of {module}" in str(err)
    assert "target_modules" in str(err) and "merge" in str(err)


def test_copies_need_served_weight(layouts, assets, make_config):
    """A runner that has no whole weight to compare with refuses rather than assumes."""
    from loraserve.runtime.lora.adapter import load_adapter
    from loraserve.runtime.model.arch import load_arch_config

    model_dir, adapter_dir = layouts["emb-head-auto"]
    arch = load_arch_config(model_dir)
    with pytest.raises(AdapterError, match="not available here to check it") as err:
        load_adapter(
            adapter_dir,
            arch=arch,
            max_rank=16,
            pool_modules=LORA_MODULES,
            dtype=torch.float32,
            base_tensor=None,
        )
    assert err.value.field in (EMBED_COPY, HEAD_COPY)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("layer_replication", [[0, 2], [1, 2]]),
        ("alora_invocation_tokens", [5, 6]),
        ("use_qalora", True),
        ("init_lora_weights", "pissa_niter_4"),
        ("init_lora_weights", "olora"),
    ],
)
def test_computation_options_refused(key, value, layouts, make_runner, tmp_path):
    """Options that change the computation are refused."""
    import shutil

    model_dir, adapter_dir = layouts["attn-auto"]
    path = Path(shutil.copytree(adapter_dir, tmp_path / "variant"))
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg[key] = value
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    err = _refused(make_runner(model_dir), "variant", path)
    assert err.field == key and key in str(err)


def test_named_adapter_folder(assets, make_runner, tmp_path):
    """peft saves an adapter not named "default" under <dir>/<name>/: the error says so."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = assets.models["llama-gqa"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(
            model, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"), adapter_name="sql"
        )
        peft_model.save_pretrained(str(tmp_path / "out"))
    runner = make_runner(model_dir)
    err = _refused(runner, "sql", tmp_path / "out")
    assert "peft adapters named ['sql']" in str(err) and str(tmp_path / "out" / "sql") in str(err)
    assert runner.lora.load("sql", tmp_path / "out" / "sql").state is AdapterState.LOADED


def test_float32_copies_load_on_a_bfloat16_serve(layouts, make_config, tmp_path):
    """Served in bf16 from a float32 checkpoint: the saved float32 copies equal the served
    weights in bf16 (the coarser dtype); a change below bf16's resolution cannot be told
    apart and loads, one above it is refused."""
    from loraserve.runtime.runner.model_runner import ModelRunner

    model_dir, adapter_dir = layouts["emb-head-auto"]
    config = make_config(model_dir)
    config.model.dtype = "bfloat16"
    runner = ModelRunner(config)
    assert runner.lora.load("emb", adapter_dir).state is AdapterState.LOADED
    err = _refused(runner, "retrained", _perturb(adapter_dir, tmp_path / "retrained", EMBED_COPY, delta=0.05))
    assert err.field == EMBED_COPY and "1 of" in str(err)
