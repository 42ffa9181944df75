"""peft's default adapter layout over real HTTP: at start-up and through the admin API.

An adapter of ``embed_tokens`` / ``lm_head`` saved by peft with its default
``save_embedding_layers="auto"`` holds whole copies of the base weights. The runtime loads
it (the copies equal the served model's) at start-up and through ``/v1/load_lora_adapter``,
and serves it; a copy that differs (a retrained embedding) and a ``modules_to_save``
adapter are 400 ``invalid_adapter``, naming the tensor or module and the fix, with nothing
changed.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.runtime.contract.config import LORA_MODULES

from .conftest import make_config, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

EMBED_COPY = "base_model.model.model.embed_tokens.base_layer.weight"


def _save_peft_adapter(dest: Path, base_dir: Path, *, seed: int, **lora) -> Path:
    """peft's own files, saved with the default save_embedding_layers ("auto")."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model.requires_grad_(False)
    lora = {"r": 8, "lora_alpha": 16, "target_modules": ["embed_tokens", "lm_head", "v_proj"], **lora}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **lora))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(peft_model.named_parameters()):
                if ".lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
                elif ".modules_to_save." in name:
                    param.add_(torch.randn(param.shape, generator=gen) * 0.1)
        peft_model.save_pretrained(str(dest), safe_serialization=True)
    return dest


@pytest.fixture(scope="module")
def files(assets, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft-files")
    model = assets.model_dir
    out = {
        "emb-auto": _save_peft_adapter(root / "emb-auto", model, seed=80),
        "emb-auto-2": _save_peft_adapter(root / "emb-auto-2", model, seed=81),
        "mts": _save_peft_adapter(
            root / "mts", model, seed=82, target_modules=["q_proj"], modules_to_save=["lm_head"]
        ),
    }
    assert EMBED_COPY in load_file(str(out["emb-auto"] / "adapter_model.safetensors"))
    bad = Path(shutil.copytree(out["emb-auto-2"], root / "retrained"))
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    tensors[EMBED_COPY] = tensors[EMBED_COPY].clone()
    tensors[EMBED_COPY][5] += 0.01  # one retrained embedding row
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    out["retrained"] = bad
    return out


async def _completion(srv, model: str) -> str:
    status, body = await srv.post(
        "/v1/completions", {"model": model, "prompt": "def main():", "max_tokens": 8, "temperature": 0}
    )
    assert status == 200, body
    return body["choices"][0]["text"]


async def test_peft_default_layout_loads(assets, files, tmp_path):
    """PEFT default layout loads at start up and through the admin API."""
    config = make_config(assets, adapters={"emb-auto": str(files["emb-auto"])})
    config.lora.target_modules = LORA_MODULES
    async with running_server(config, tmp_path) as srv:
        headers = srv.admin_headers()
        # start-up: served, and it changes the output
        base = await _completion(srv, "tiny-base")
        assert await _completion(srv, "emb-auto") != base
        # admin API: the same layout loads
        status, body = await srv.post(
            "/v1/load_lora_adapter",
            {"lora_name": "emb-auto-2", "lora_path": str(files["emb-auto-2"])},
            headers=headers,
        )
        assert status == 200 and body["status"] == "loaded", body
        assert set(body["target_modules"]) == {"embed_tokens", "lm_head", "v_proj"}
        assert await _completion(srv, "emb-auto-2") != base
        status, models = await srv.get("/v1/models")
        before = {m["id"] for m in models["data"]}

        # a retrained embedding copy: 400 naming the tensor and the fix
        status, body = await srv.post(
            "/v1/load_lora_adapter",
            {"lora_name": "retrained", "lora_path": str(files["retrained"])},
            headers=headers,
        )
        assert status == 400, body
        error = body["error"]
        assert error["code"] == "invalid_adapter" and error["param"] == EMBED_COPY
        assert EMBED_COPY in error["message"] and "differ from the served model's" in error["message"]
        assert "save_embedding_layers=False" in error["message"] and "as the base" in error["message"]

        # modules_to_save: 400 naming the module
        status, body = await srv.post(
            "/v1/load_lora_adapter", {"lora_name": "mts", "lora_path": str(files["mts"])}, headers=headers
        )
        assert status == 400, body
        assert body["error"]["code"] == "invalid_adapter" and body["error"]["param"] == "modules_to_save"
        assert "modules_to_save=['lm_head']" in body["error"]["message"]

        status, models = await srv.get("/v1/models")
        assert {m["id"] for m in models["data"]} == before, "a refused adapter changes nothing"
        assert await _completion(srv, "emb-auto") != base
