"""``loraserve-runtime``: flags -> configuration, the start-up policy gate, and the process
lifecycle (ready, graceful SIGTERM with in-flight work, a model that fails to load), run as
real subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from loraserve.runtime.cli import build_parser, config_from_args
from loraserve.runtime.contract.config import RuntimeConfig, SpecAlgorithm
from loraserve.runtime.contract.policy import check_config
from loraserve.runtime.dev.demo import free_port

from .runtime_process import ready_turns_503, runtime_process, wait_ready


def _parse(argv: list[str]) -> RuntimeConfig:
    return config_from_args(build_parser().parse_args(argv), env={})


def test_flags_become_the_configuration(assets, tmp_path):
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    cfg = _parse([
        "--model", str(assets.model_dir), "--lora", f"a={assets.demo.adapters['sql-r8']}",
        "--lora", f"b={assets.demo.adapters['chat-r16']}", "--pinned-loras", "b",
        "--max-loras-per-batch", "3", "--max-loaded-loras", "9", "--max-lora-rank", "32",
        "--lora-target-modules", "q_proj", "v_proj", "--speculative-algorithm", "ngram", "--num-steps", "5",
        "--port", "9001", "--host", "127.0.0.1", "--admin-token-file", str(token), "--dtype", "float32",
        "--device", "cpu", "--max-running-requests", "7", "--max-total-tokens", "4096", "--no-enable-lora",
        "--max-admission-defer-steps", "0", "--speculative-disable-batch-size", "16",
        "--speculative-tree-max-batch-size", "4",
        "--speculative-auto-disable",
    ])  # fmt: skip
    assert cfg.model.architecture == "LlamaForCausalLM"  # read from config.json
    assert cfg.lora.adapters == {
        "a": str(assets.demo.adapters["sql-r8"]),
        "b": str(assets.demo.adapters["chat-r16"]),
    }
    assert cfg.lora.pinned == ("b",) and cfg.lora.enabled is False
    assert (cfg.lora.max_loras_per_batch, cfg.lora.max_loaded_loras, cfg.lora.max_rank) == (3, 9, 32)
    assert cfg.lora.target_modules == ("q_proj", "v_proj")
    assert cfg.speculative.algorithm is SpecAlgorithm.NGRAM
    assert cfg.speculative.num_draft_tokens == 6  # num_steps + 1 by default
    assert (cfg.server.port, cfg.server.host, cfg.server.admin_token) == (9001, "127.0.0.1", "s3cret")
    assert (cfg.scheduler.max_running_requests, cfg.scheduler.max_total_tokens) == (7, 4096)
    assert cfg.scheduler.max_admission_defer_steps == 0
    assert cfg.speculative.disable_batch_size == 16
    assert cfg.speculative.tree_max_batch_size == 4
    assert (
        _parse(["--model", "m"]).speculative.disable_batch_size
        == RuntimeConfig().speculative.disable_batch_size
    )
    assert cfg.speculative.auto_disable is True
    assert cfg.attention_backend == "auto" == RuntimeConfig().attention_backend
    assert _parse(["--model", "m", "--attention-backend", "triton"]).attention_backend == "triton"
    assert _parse(["--model", "m"]).speculative.auto_disable is RuntimeConfig().speculative.auto_disable
    assert _parse(["--model", "m", "--no-speculative-auto-disable"]).speculative.auto_disable is False
    assert _parse(["--model", "m", "--lora-target-modules", "all"]).lora.target_modules[-1] == "lm_head"
    assert (
        config_from_args(
            build_parser().parse_args(["--model", "m"]), env={"LORASERVE_ADMIN_TOKEN": "t"}
        ).server.admin_token
        == "t"
    )


def test_the_operators_command_line_round_trips(assets):
    """The operator renders a RuntimeConfig as flags; parsing them gives the same configuration."""
    from loraserve.operator.desired import runtime_args

    cfg = RuntimeConfig()
    cfg.model.path = str(assets.model_dir)
    cfg.model.served_name = "base"
    cfg.model.architecture = "LlamaForCausalLM"
    cfg.model.context_length = 512
    cfg.speculative.algorithm = SpecAlgorithm.STANDALONE
    cfg.speculative.draft_model_path = str(assets.demo.draft_dir)
    cfg.speculative.draft_model_architecture = "LlamaForCausalLM"
    cfg.speculative.num_steps, cfg.speculative.num_draft_tokens = 2, 3
    cfg.lora.adapters = {"x": "/adapters/x", "y": "/adapters/y"}
    cfg.server.allowed_local_roots = ("/adapters", "/models")  # the operator always passes its roots
    cfg.lora.pinned = ("y",)
    cfg.lora.target_modules = ("q_proj", "o_proj", "lm_head")
    cfg.scheduler.max_total_tokens = 1234
    cfg.scheduler.max_admission_defer_steps = 3
    cfg.speculative.disable_batch_size = 12
    cfg.speculative.auto_disable = True
    cfg.cuda_graph.enabled = True
    cfg.cuda_graph.max_bs = 16
    cfg.cuda_graph.max_prefill_tokens = 128
    cfg.attention_backend = "triton"
    cfg.seed = 5
    parsed = _parse(runtime_args(cfg))
    assert parsed.to_dict() == cfg.to_dict()


def _run_cli(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    return subprocess.run(
        [sys.executable, "-m", "loraserve.runtime", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_start_up_lists_every_reason(assets, tmp_path):
    """Start up refuses a bad configuration listing every reason."""
    args = [
        "--model",
        str(assets.model_dir),
        "--speculative-algorithm",
        "EAGLE",
        "--overlap-schedule",
        "--two-batch-overlap",
        "--max-loras-per-batch",
        "40",
        "--max-loaded-loras",
        "8",
        "--lora",
        f"gone={tmp_path / 'missing'}",
        "--device",
        "cpu",
    ]
    proc = _run_cli(args)
    assert proc.returncode == 2, proc.stderr
    cfg = _parse(args)
    report = check_config(cfg)
    assert len(report.violations) >= 3
    for violation in report.violations:
        assert violation.render() in proc.stderr
    assert "gone=" in proc.stderr and "adapter_config.json" in proc.stderr
    assert f"{len(report.violations) + 1} problem(s)" in proc.stderr


def test_warnings_and_check_config(assets):
    """Warnings are printed and check config shows the effective configuration."""
    proc = _run_cli(
        ["--model", str(assets.model_dir), "--max-lora-rank", "512", "--device", "cpu", "--check-config"]
    )
    assert proc.returncode == 0, proc.stderr
    assert "warning: lora.max_rank" in proc.stderr
    effective = json.loads(proc.stdout)
    assert effective["lora"]["max_rank"] == 512 and effective["model"]["path"] == str(assets.model_dir)
    bad = _run_cli(["--model", "m", "--lora", "no-equals-sign"])
    assert bad.returncode == 2 and "--lora NAME=DIR" in bad.stderr


@pytest.mark.slow
async def test_sigterm_finishes_in_flight(assets, tmp_path):
    """Sigterm finishes in flight requests then exits cleanly."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "log"
    with runtime_process(
        [
            "--model",
            str(assets.model_dir),
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-total-tokens",
            "4096",
            "--max-lora-rank",
            "16",
            "--lora",
            f"sql={assets.demo.adapters['sql-r8']}",
            "--drain-timeout",
            "30",
        ],
        log,
    ) as proc:
        await wait_ready(url, proc, log)
        async with aiohttp.ClientSession() as session:
            body = {
                "model": "sql",
                "prompt": "x = [",
                "max_tokens": 300,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readline()
                assert first.startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                # Draining: the listener stays open (issue 20: it used to close at once, so
                # probes met a refused connection) and /ready turns 503.
                async with aiohttp.ClientSession() as other:
                    ready = await ready_turns_503(other, url, tries=300)
                    assert ready is not None, "/ready never turned 503 after SIGTERM"
                    async with other.get(url + "/health") as r:
                        assert r.status == 200
                rest = await resp.content.read()
            events = [
                json.loads(line[6:])
                for line in (first + rest).decode().splitlines()
                if line.startswith("data: {")
            ]
            text_events = [e for e in events if e["choices"]]
            assert text_events[-1]["choices"][0]["finish_reason"] == "length"
            assert (first + rest).decode().rstrip().endswith("data: [DONE]")
        assert proc.wait(timeout=60) == 0


@pytest.mark.slow
def test_model_load_failure_stops(assets, tmp_path):
    """A model that fails to load stops the process."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((assets.model_dir / name).read_bytes())
    port = free_port()
    with runtime_process(
        [
            "--model",
            str(broken),
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-total-tokens",
            "1024",
        ],
        tmp_path / "log",
    ) as proc:
        assert proc.wait(timeout=90) == 1
    log = (tmp_path / "log").read_text()
    assert "the model failed to load" in log
