"""The image (Dockerfile) against the package and the chart.

The image cannot be built here (no registry access for the CUDA base); what can be checked
is that it runs what the package installs and what the chart and the operator expect.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from loraserve.operator import desired
from loraserve.operator.config import DEFAULT_IMAGE

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
CHART = yaml.safe_load((REPO / "charts" / "loraserve" / "Chart.yaml").read_text())
VALUES = yaml.safe_load((REPO / "charts" / "loraserve" / "values.yaml").read_text())


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    instructions = _instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def _arg(name: str) -> str:
    for word, rest in _final_stage():
        if word == "ARG" and rest.startswith(f"{name}="):
            return rest.split("=", 1)[1]
    raise AssertionError(f"the final stage declares no ARG {name}")


def test_entrypoints_are_loadable_scripts() -> None:
    """Every entrypoint is a package script that loads."""
    label = next(
        rest for word, rest in _final_stage() if word == "LABEL" and "io.loraserve.entrypoints" in rest
    )
    named = re.search(r'io\.loraserve\.entrypoints="([^"]+)"', label).group(1).split()
    assert named == ["loraserve-runtime", "loraserve-operator", "loraserve-fetch", "loraserve-token-map"]
    installed = {ep.name: ep for ep in importlib.metadata.entry_points(group="console_scripts")}
    for script in named:
        assert script in SCRIPTS, f"{script} is not in pyproject's [project.scripts]"
        assert callable(installed[script].load()), f"{script} does not load"
    run = " ".join(rest for word, rest in _final_stage() if word == "RUN")
    for script in named:
        assert f"command -v {script}" in run, "the build checks each entrypoint is on PATH"
    cmd = next(rest for word, rest in _final_stage() if word == "CMD")
    assert yaml.safe_load(cmd)[0] in SCRIPTS


def test_entrypoints_start(tmp_path: Path) -> None:
    bindir = Path(sys.executable).parent
    for script in ("loraserve-runtime", "loraserve-operator", "loraserve-fetch", "loraserve-token-map"):
        result = subprocess.run(
            [str(bindir / script), "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=120
        )
        assert result.returncode == 0, result.stderr
        assert script in result.stdout


def test_user_is_shared_non_root_uid() -> None:
    """User is the non root uid the chart and operator use."""
    user = next(rest for word, rest in _final_stage() if word == "USER")
    assert user.isdigit() and int(user) != 0, "a numeric non-root USER lets Kubernetes enforce runAsNonRoot"
    assert int(user) == int(_arg("UID")) == desired.RUNTIME_UID
    assert VALUES["podSecurityContext"]["runAsUser"] == int(user)


def test_versions_and_image_names_agree() -> None:
    version = PYPROJECT["project"]["version"]
    assert CHART["appVersion"] == version == _arg("VERSION")
    assert VALUES["image"]["tag"] == "", "the chart defaults the tag to its appVersion"
    assert f"{VALUES['image']['repository']}:{CHART['appVersion']}" == DEFAULT_IMAGE


def test_chart_runs_the_operator_entrypoint(render) -> None:
    deployment = next(o for o in render() if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["loraserve-operator"]
    assert container["image"] == DEFAULT_IMAGE
    assert desired.RUNTIME_COMMAND in SCRIPTS
    assert desired.FETCH_COMMAND in SCRIPTS  # the serving pods' init containers run it


def test_build_context_holds_copied_files() -> None:
    """Build context holds what the dockerfile copies."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]

    def ignored(path: str) -> bool:
        result = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            body = pattern[1:] if negate else pattern
            body = body.rstrip("/")
            if body == "**" or fnmatch.fnmatch(path, body) or path.startswith(body + "/"):
                result = not negate
        return result

    copied = []
    for word, rest in _instructions():
        if word == "COPY" and "--from" not in rest:
            copied.extend(shlex.split(rest)[:-1])
    assert copied, "the Dockerfile copies the sources"
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not ignored(source.rstrip("/")), f"COPY {source}: excluded by .dockerignore"
    packages = {"operator", "runtime", "kernels"}
    assert packages <= {s.rstrip("/").split("/")[0] for s in copied}
