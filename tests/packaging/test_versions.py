"""The torch and Triton versions the project states, against those its kernels ran on.

Four places name them and must move together: the image's base (Dockerfile ``BASE_IMAGE``),
pyproject's bounds (``torch``, the ``triton`` extra), the runtime's start-up check
(``capabilities.TRITON_OLDEST``) and the versions the GPU results in ``bench/results/``
recorded in their markdowns. Bumping one without the others fails here. The runtime's refusal of an older
Triton is tested through the check function and through ``loraserve-runtime``'s start-up.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from loraserve.runtime import cli
from loraserve.runtime.contract import capabilities
from loraserve.runtime.contract.config import RuntimeConfig

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BASE_TAG = re.compile(r"^pytorch/pytorch:(?P<torch>\d+\.\d+\.\d+)-cuda(?P<cuda>\d+\.\d+)-cudnn\d+-runtime$")

# The Triton each official torch release pins on Linux (its wheel's metadata:
# `Requires-Dist: triton==X; platform_system == "Linux"`), so the base image's Triton is
# known without pulling it. A new base needs its pair here, read from that torch's metadata.
TORCH_PINS_TRITON = {"2.11.0": "3.6.0"}


def _base_image() -> str:
    match = re.search(r"^ARG BASE_IMAGE=(\S+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert match, "the Dockerfile declares ARG BASE_IMAGE=<image>"
    return match.group(1)


def _requirement(name: str, extra: str | None = None) -> Requirement:
    deps = PYPROJECT["project"]["optional-dependencies"][extra] if extra else PYPROJECT["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == name]
    return req


def _bounds(req: Requirement) -> tuple[Version, Version]:
    """``>=low,<high`` and nothing else: the range must be stated from both ends."""
    ops = {s.operator: Version(s.version) for s in req.specifier}
    assert set(ops) == {">=", "<"}, f"{req}: state the supported range as >=oldest,<next-minor-after-newest"
    return ops[">="], ops["<"]


# A GPU run's markdown names its card and the versions it ran: "NVIDIA H200 ...; torch
# 2.11.0+cu130; triton 3.6.0" (separators vary: ",", ";", ":"). The date is the file's prefix.
_GPU = re.compile(r"NVIDIA [HABL]\d+")
_TORCH = re.compile(r"\btorch:?\s+(\d+\.\d+\.\d+\+cu\d+)", re.IGNORECASE)
_TRITON = re.compile(r"\btriton:?\s+(\d+\.\d+\.\d+)", re.IGNORECASE)


def _gpu_records() -> list[dict]:
    """The versions of every GPU run under bench/results/ (one markdown per study)."""
    records = []
    for path in sorted((ROOT / "bench" / "results").glob("2*.md")):
        text = path.read_text()
        torch_v, triton_v = _TORCH.search(text), _TRITON.search(text)
        if _GPU.search(text) and torch_v and triton_v:
            records.append({"date": path.name[:10], "torch": torch_v[1], "triton": triton_v[1], "file": path.name})
    assert records, "bench/results/ holds GPU runs with their versions"
    return records


def _minor(v: Version) -> tuple[int, int]:
    return v.major, v.minor


def _next_minor(v: Version) -> Version:
    return Version(f"{v.major}.{v.minor + 1}")


def _dev_pin(name: str) -> Version:
    """The version requirements-dev.txt pins for the CPU tests (the ones CI runs)."""
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        match = re.match(rf"^{name}==(\S+)", line.strip())
        if match:
            return Version(match.group(1))
    raise AssertionError(f"requirements-dev.txt pins no {name}")


def test_base_image_matches_gpu_results() -> None:
    """The base image is the torch and CUDA of the latest GPU results."""
    latest = max(_gpu_records(), key=lambda env: env["date"])
    match = BASE_TAG.match(_base_image())
    assert match, f"BASE_IMAGE {_base_image()}: expected an official pytorch/pytorch:<torch>-cuda<x.y>-cudnn<n>-runtime"
    torch_version, _, local = latest["torch"].partition("+")
    assert match["torch"] == torch_version, f"the base's torch against {latest['file']} ({latest['torch']})"
    assert local == "cu" + match["cuda"].replace(".", ""), f"the base's CUDA against {latest['file']} ({latest['torch']})"
    assert match["torch"] in TORCH_PINS_TRITON, "add the base torch's Triton pin to TORCH_PINS_TRITON"
    assert TORCH_PINS_TRITON[match["torch"]] == latest["triton"], (
        f"the base ships Triton {TORCH_PINS_TRITON[match['torch']]}; {latest['file']} ran {latest['triton']}"
    )
    assert _base_image() == capabilities.BASE_IMAGE_HINT, "the runtime's refusal names the image's base"


def test_the_triton_extra_spans_what_ran() -> None:
    low, high = _bounds(_requirement("triton", extra="triton"))
    gpu = [Version(env["triton"]) for env in _gpu_records()]
    ran = [*gpu, _dev_pin("triton")]
    # The oldest supported is the oldest version any GPU run used, and the runtime's check agrees.
    assert _minor(low) == _minor(min(gpu)), f"triton>={low}: the oldest GPU run used {min(gpu)}"
    assert _minor(low) == capabilities.TRITON_OLDEST
    # The newest supported is the newest run (GPU or the CPU tests), up to its next minor.
    assert high == _next_minor(max(ran)), f"triton<{high}: the newest run used {max(ran)}"
    assert all(v in _requirement("triton", extra="triton").specifier for v in ran)
    base_triton = Version(TORCH_PINS_TRITON[BASE_TAG.match(_base_image())["torch"]])
    assert base_triton in _requirement("triton", extra="triton").specifier, "pip keeps the base's Triton"


def test_the_torch_bounds_span_what_ran() -> None:
    low, high = _bounds(_requirement("torch"))
    gpu = [Version(env["torch"].partition("+")[0]) for env in _gpu_records()]
    ran = [*gpu, _dev_pin("torch")]
    base = Version(BASE_TAG.match(_base_image())["torch"])
    assert _minor(low) == _minor(min(gpu)), f"torch>={low}: the oldest GPU run used {min(gpu)}"
    assert high == _next_minor(max(ran)), f"torch<{high}: the newest run used {max(ran)}"
    assert base in _requirement("torch").specifier, "pip keeps the base's torch"


def test_image_installs_triton_extra() -> None:
    """The image installs the triton extra and checks it."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r'pip install [^\n]*"\$\{wheel\}\[[^\]]*\btriton\b[^\]]*\]"', dockerfile)
    assert "triton_version_problem" in dockerfile, "the build runs the runtime's own Triton check"


# --- the runtime's refusal ---------------------------------------------------------------


def _cfg(**kw) -> RuntimeConfig:
    cfg = RuntimeConfig()
    cfg.device = kw.pop("device", "auto")
    cfg.attention_backend = kw.pop("attention", "auto")
    cfg.lora.backend = kw.pop("lora", "auto")
    cfg.lora.enabled = kw.pop("lora_enabled", True)
    assert not kw
    return cfg


@pytest.mark.parametrize("version", ["3.2.0", "3.1.0", "3.5.1", "3.5.0+git4f6f7e1", "2.3.1"])
def test_older_triton_refused(version) -> None:
    """An older triton is refused with the versions and the fix."""
    used = capabilities.triton_kernels_used(_cfg(), cuda_available=True)
    assert used == ["LoRA (--lora-backend auto)", "paged attention (--attention-backend auto)"]
    problem = capabilities.triton_version_problem(version, used)
    assert problem is not None
    assert f"triton {version} is installed" in problem
    assert "oldest Triton the LoRA (--lora-backend auto) and paged attention" in problem
    assert "is 3.6" in problem and "install triton>=3.6" in problem
    assert "pip install 'loraserve[triton]'" in problem and capabilities.BASE_IMAGE_HINT in problem
    assert "--lora-backend torch --attention-backend sdpa" in problem


@pytest.mark.parametrize("version", ["3.6.0", "3.6.1", "3.9.0", "3.10.0", "4.0.0", "3.7.0+fb", "not-a-version"])
def test_a_supported_triton_starts(version) -> None:
    assert capabilities.triton_version_problem(version, ["LoRA (--lora-backend auto)"]) is None


@pytest.mark.parametrize(
    ("cfg", "cuda", "used"),
    [
        (_cfg(), False, []),  # auto on a machine without CUDA: the CPU and the torch reference
        (_cfg(device="cpu", lora="torch", attention="sdpa"), False, []),
        (_cfg(device="cpu", lora="triton", attention="triton"), False, []),  # the interpreter (tests)
        (_cfg(device="cpu"), True, []),  # CPU asked for on a CUDA machine
        (_cfg(device="cuda", lora="torch", attention="sdpa"), True, []),
        (_cfg(device="cuda", lora_enabled=False, attention="sdpa"), True, []),
        (_cfg(device="cuda", lora="torch"), True, ["paged attention (--attention-backend auto)"]),
        (_cfg(lora="triton", attention="sdpa"), True, ["LoRA (--lora-backend triton)"]),
    ],
)
def test_only_triton_on_cuda_judged(cfg, cuda, used) -> None:
    """Only a start that runs triton on CUDA is judged."""
    assert capabilities.triton_kernels_used(cfg, cuda_available=cuda) == used
    refused = capabilities.triton_version_problem("3.2.0", used) is not None
    assert refused == bool(used)
    assert capabilities.triton_version_problem(None, used) is None  # no triton: nothing to judge here


def test_version_tuple() -> None:
    assert capabilities.version_tuple("3.6.0") == (3, 6, 0)
    assert capabilities.version_tuple("3.5.0+git4f6f7e1") == (3, 5, 0)
    assert capabilities.version_tuple("3.10.0rc1") == (3, 10, 0)
    assert capabilities.version_tuple("dev") == ()


@pytest.fixture
def model_dir(tmp_path) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_start_up_refuses_an_old_triton_on_cuda(model_dir, monkeypatch, capsys) -> None:
    """``loraserve-runtime`` (its ``--check-config`` start-up gate) with Triton 3.2 installed:
    refused on CUDA with the reason, started on the CPU with the torch backend."""
    monkeypatch.setattr(capabilities, "installed_triton_version", lambda: "3.2.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["--model", str(model_dir), "--check-config"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "refusing to start" in err and "triton 3.2.0 is installed" in err and "install triton>=3.6" in err

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--model", str(model_dir), "--lora-backend", "torch", "--check-config"]) == 0
    assert cli.main(["--model", str(model_dir), "--device", "cpu", "--check-config"]) == 0
    assert "triton" not in capsys.readouterr().err


def test_start_up_accepts_the_installed_triton(model_dir, monkeypatch) -> None:
    """The Triton the CPU tests run (3.9) passes the same gate on CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert capabilities.check_triton(_cfg()) is None
    assert cli.main(["--model", str(model_dir), "--device", "cuda", "--check-config"]) == 0
