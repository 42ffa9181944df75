"""``loraserve-runtime``: flags -> ``RuntimeConfig`` -> compatibility check -> HTTP server.

Start-up refuses to run a configuration the compatibility policy
(``loraserve.runtime.contract.policy.check_config``) rejects, printing every reason at once, and
prints its warnings. The model then loads in the background while ``/health`` already
answers; ``/ready`` turns 200 once it serves. SIGTERM (and SIGINT) drain: the socket keeps
listening, ``/ready`` answers 503 and new requests 503 with ``Retry-After``, in-flight ones
get ``--drain-timeout`` seconds to finish (a second signal cuts the wait short), the rest
are aborted, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .contract.capabilities import check_triton
from .contract.config import LORA_MODULES, RaggedVerify, RuntimeConfig, SpecAlgorithm

log = logging.getLogger("loraserve.runtime")

EXIT_CONFIG = 2  # a bad flag or a configuration the policy refuses


class ConfigError(ValueError):
    """A flag value that cannot become a configuration; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    d = RuntimeConfig()
    p = argparse.ArgumentParser(
        prog="loraserve-runtime",
        description="Serve one base model with many LoRA adapters (OpenAI-compatible API).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bool_flag = argparse.BooleanOptionalAction

    g = p.add_argument_group("model")
    g.add_argument(
        "--model", required=True, help="local directory with config.json, safetensors and tokenizer"
    )
    g.add_argument("--revision", default=None, help="recorded revision of the model files")
    g.add_argument("--dtype", default=d.model.dtype, choices=("auto", "bfloat16", "float16", "float32"))
    g.add_argument("--context-length", type=int, default=None, help="default: the model's max positions")
    g.add_argument(
        "--served-model-name", default=None, help="the `model` name of the base (default: dir name)"
    )
    g.add_argument("--architecture", default=None, help="override config.json's architecture")

    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-algorithm", default="NONE", type=str.upper, choices=[a.value for a in SpecAlgorithm]
    )
    g.add_argument("--draft-model", default=None, help="local directory of the draft model")
    g.add_argument("--draft-model-architecture", default=None)
    g.add_argument("--num-steps", type=int, default=d.speculative.num_steps)
    g.add_argument("--top-k", type=int, default=d.speculative.top_k, help="draft tree width (1: chain)")
    g.add_argument("--num-draft-tokens", type=int, default=None, help="verify width (default: num-steps + 1)")
    g.add_argument("--adaptive-speculation", action=bool_flag, default=d.speculative.adaptive)
    g.add_argument(
        "--ragged-verify", default=d.speculative.ragged_verify.value, choices=[r.value for r in RaggedVerify]
    )
    g.add_argument("--draft-load-format", default=d.speculative.draft_load_format)
    g.add_argument(
        "--speculative-token-map",
        default=None,
        help="EAGLE/EAGLE3: a .json/.safetensors/.pt list of token ids the draft predicts over "
        "(relative: a file of the draft's directory)",
    )
    g.add_argument("--ngram-min", type=int, default=d.speculative.ngram_min)
    g.add_argument("--ngram-max", type=int, default=d.speculative.ngram_max)
    g.add_argument(
        "--speculative-disable-batch-size",
        type=int,
        default=d.speculative.disable_batch_size,
        help="decode steps of at least this many requests skip drafting, one token each (0: always speculate)",
    )
    g.add_argument(
        "--speculative-tree-max-batch-size",
        type=int,
        default=d.speculative.tree_max_batch_size,
        help="tree drafts (--top-k > 1): decode steps of more than this many requests verify chains instead (0: trees always)",
    )
    g.add_argument(
        "--speculative-auto-disable",
        action=bool_flag,
        default=d.speculative.auto_disable,
        help="per batch-size bucket, draft only while drafting yields more tokens/s than plain decoding "
        "(measured on this serve's own steps)",
    )

    g = p.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action=bool_flag, default=d.lora.enabled)
    g.add_argument("--max-loras-per-batch", type=int, default=d.lora.max_loras_per_batch)
    g.add_argument("--max-loaded-loras", type=int, default=d.lora.max_loaded_loras)
    g.add_argument("--max-lora-rank", type=int, default=d.lora.max_rank)
    g.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=list(d.lora.target_modules),
        metavar="MODULE",
        help=f"any of {', '.join(LORA_MODULES)}, or 'all'",
    )
    g.add_argument("--lora-backend", default=d.lora.backend, choices=("auto", "triton", "torch"))
    g.add_argument("--overlap-lora-loading", action=bool_flag, default=d.lora.overlap_loading)
    g.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="an adapter to load at start-up (repeatable)",
    )
    g.add_argument(
        "--pinned-loras", nargs="+", default=[], metavar="NAME", help="start-up adapters that keep a GPU slot"
    )
    g.add_argument(
        "--adapter-catalog",
        default=d.lora.catalog,
        metavar="FILE",
        help="the serve's adapter catalog (JSON); catalogued adapters load on their first request",
    )
    g.add_argument(
        "--adapter-load-timeout",
        type=float,
        default=d.lora.load_timeout_s,
        metavar="SECONDS",
        help="how long a request waits for an on-demand adapter load before a 503 with Retry-After",
    )

    g = p.add_argument_group("scheduler")
    g.add_argument("--max-running-requests", type=int, default=d.scheduler.max_running_requests)
    g.add_argument(
        "--max-total-tokens", type=int, default=None, help="KV cache tokens (default: from memory)"
    )
    g.add_argument("--chunked-prefill-size", type=int, default=d.scheduler.chunked_prefill_size)
    g.add_argument("--max-prefill-tokens", type=int, default=d.scheduler.max_prefill_tokens)
    g.add_argument(
        "--max-admission-defer-steps",
        type=int,
        default=d.scheduler.max_admission_defer_steps,
        help="decode steps admission may wait under a backlog to batch prefills (0: admit at once)",
    )
    g.add_argument("--overlap-schedule", action=bool_flag, default=d.scheduler.overlap_schedule)
    g.add_argument("--two-batch-overlap", action=bool_flag, default=d.scheduler.two_batch_overlap)
    g.add_argument("--kv-memory-fraction", type=float, default=d.scheduler.kv_memory_fraction)

    g = p.add_argument_group("device")
    g.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"))
    g.add_argument("--cuda-graph", action=bool_flag, default=d.cuda_graph.enabled)
    g.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=("auto", "sdpa", "triton"),
        help="decode/verify attention: sdpa gathers each context; triton reads the paged cache in place (CUDA); "
        "auto: triton on CUDA when installed, else sdpa",
    )
    g.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph.max_bs)
    g.add_argument(
        "--cuda-graph-max-prefill-tokens",
        type=int,
        default=d.cuda_graph.max_prefill_tokens,
        help="one-request prefill chunks of up to this many tokens replay CUDA graphs (0: prefill runs eagerly)",
    )
    g.add_argument("--tensor-parallel-size", type=int, default=d.parallel.tensor_parallel_size)
    g.add_argument("--seed", type=int, default=d.seed)

    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.server.host)
    g.add_argument("--port", type=int, default=d.server.port)
    g.add_argument(
        "--admin-token-file",
        default=None,
        help="file holding the bearer token of the admin routes (default: $LORASERVE_ADMIN_TOKEN; "
        "neither: admin routes are open)",
    )
    g.add_argument("--adapter-cache-dir", default=d.server.adapter_cache_dir)
    g.add_argument(
        "--pvc-root", default="/mnt/pvc", help="where pvc://<claim>/... adapter sources are mounted"
    )
    g.add_argument("--adapter-ca-file", default=None, help="extra CA bundle for https adapter sources")
    g.add_argument(
        "--allowed-local-roots",
        nargs="+",
        default=list(d.server.allowed_local_roots),
        metavar="DIR",
        help="plain-path and file:// adapter sources, --lora adapters and the model must resolve (symlinks "
        "followed) inside these directories (default: not confined)",
    )
    g.add_argument(
        "--remote-source-hosts",
        nargs="+",
        default=list(d.server.remote_source_hosts),
        metavar="HOST",
        help="hosts https://, s3:// and hf:// adapter sources may reach, redirects included; "
        "*.example.com allows its subdomains; commas separate too (default: any host)",
    )
    g.add_argument("--max-body-bytes", type=int, default=d.server.max_body_bytes)
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    g.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    g.add_argument(
        "--check-config",
        action="store_true",
        help="print the effective configuration and the policy's verdict, then exit",
    )
    return p


def _adapter_flags(values: Sequence[str]) -> dict[str, str]:
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--lora {value!r}: use --lora NAME=DIR")
        name = name.strip()
        if name in adapters:
            raise ConfigError(f"--lora {name!r} is given twice: each adapter name once")
        adapters[name] = path.strip()
    return adapters


def _read_architecture(model_dir: str | None) -> str | None:
    """``architectures[0]`` from a model's config.json, when readable."""
    if not model_dir:
        return None
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    archs = data.get("architectures") if isinstance(data, dict) else None
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def _admin_token(args: argparse.Namespace, env: dict[str, str]) -> str | None:
    if args.admin_token_file:
        try:
            token = Path(args.admin_token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"--admin-token-file {args.admin_token_file}: cannot read it ({exc.strerror})"
            ) from None
        if not token:
            raise ConfigError(f"--admin-token-file {args.admin_token_file} is empty")
        return token
    return env.get("LORASERVE_ADMIN_TOKEN") or None


def config_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> RuntimeConfig:
    """The ``RuntimeConfig`` the flags describe (no validation beyond parsing)."""
    env = dict(os.environ) if env is None else env
    cfg = RuntimeConfig()
    m = cfg.model
    m.path = args.model
    m.revision = args.revision
    m.dtype = args.dtype
    m.context_length = args.context_length
    m.served_name = args.served_model_name
    m.architecture = args.architecture or _read_architecture(args.model)

    s = cfg.speculative
    s.algorithm = SpecAlgorithm(args.speculative_algorithm)
    s.draft_model_path = args.draft_model
    s.draft_model_architecture = args.draft_model_architecture or _read_architecture(args.draft_model)
    s.num_steps = args.num_steps
    s.top_k = args.top_k
    s.num_draft_tokens = args.num_draft_tokens if args.num_draft_tokens is not None else args.num_steps + 1
    s.adaptive = args.adaptive_speculation
    s.ragged_verify = RaggedVerify(args.ragged_verify)
    s.draft_load_format = args.draft_load_format
    s.token_map = args.speculative_token_map
    s.ngram_min = args.ngram_min
    s.ngram_max = args.ngram_max
    s.disable_batch_size = args.speculative_disable_batch_size
    s.tree_max_batch_size = args.speculative_tree_max_batch_size
    s.auto_disable = args.speculative_auto_disable

    lora = cfg.lora
    lora.enabled = args.enable_lora
    lora.max_loras_per_batch = args.max_loras_per_batch
    lora.max_loaded_loras = args.max_loaded_loras
    lora.max_rank = args.max_lora_rank
    modules = list(args.lora_target_modules)
    lora.target_modules = LORA_MODULES if modules == ["all"] else tuple(modules)
    lora.backend = args.lora_backend
    lora.overlap_loading = args.overlap_lora_loading
    lora.adapters = _adapter_flags(args.lora)
    unknown_pins = sorted(set(args.pinned_loras) - set(lora.adapters))
    if unknown_pins:
        raise ConfigError(f"--pinned-loras {', '.join(unknown_pins)}: not given with --lora NAME=DIR")
    lora.pinned = tuple(args.pinned_loras)
    if not args.adapter_load_timeout > 0 or args.adapter_load_timeout > 3600:
        raise ConfigError(f"--adapter-load-timeout {args.adapter_load_timeout:g}: give seconds in (0, 3600]")
    lora.load_timeout_s = args.adapter_load_timeout
    lora.catalog = args.adapter_catalog

    sch = cfg.scheduler
    sch.max_running_requests = args.max_running_requests
    sch.max_total_tokens = args.max_total_tokens
    sch.chunked_prefill_size = args.chunked_prefill_size
    sch.max_prefill_tokens = args.max_prefill_tokens
    sch.max_admission_defer_steps = args.max_admission_defer_steps
    sch.overlap_schedule = args.overlap_schedule
    sch.two_batch_overlap = args.two_batch_overlap
    sch.kv_memory_fraction = args.kv_memory_fraction

    cfg.cuda_graph.enabled = args.cuda_graph
    cfg.cuda_graph.max_bs = args.cuda_graph_max_bs
    cfg.cuda_graph.max_prefill_tokens = args.cuda_graph_max_prefill_tokens
    cfg.parallel.tensor_parallel_size = args.tensor_parallel_size
    cfg.device = args.device
    cfg.attention_backend = args.attention_backend
    cfg.seed = args.seed

    srv = cfg.server
    srv.host = args.host
    srv.port = args.port
    srv.admin_token = _admin_token(args, env)
    srv.adapter_cache_dir = args.adapter_cache_dir
    srv.max_body_bytes = args.max_body_bytes
    srv.allowed_local_roots = _roots(args.allowed_local_roots)
    srv.remote_source_hosts = tuple(
        h.strip() for value in args.remote_source_hosts for h in value.split(",") if h.strip()
    )
    return cfg


def _roots(values: Sequence[str]) -> tuple[str, ...]:
    for value in values:
        if not os.path.isabs(value):
            raise ConfigError(f"--allowed-local-roots {value}: give absolute directories")
    return tuple(values)


def _local_checks(cfg: RuntimeConfig) -> list[str]:
    """Start-up facts the pure policy cannot know: files on this machine, ports, the Triton installed."""
    problems = []
    if not (Path(cfg.model.path) / "config.json").is_file():
        problems.append(
            f"--model {cfg.model.path}: no config.json there; point it at a local model directory"
        )
    if (
        cfg.speculative.enabled
        and cfg.speculative.draft_model_path
        and not (Path(cfg.speculative.draft_model_path) / "config.json").is_file()
    ):
        problems.append(f"--draft-model {cfg.speculative.draft_model_path}: no config.json there")
    for name, path in cfg.lora.adapters.items():
        if not (Path(path) / "adapter_config.json").is_file():
            problems.append(f"--lora {name}={path}: no adapter_config.json there")
    problems += _outside_roots(cfg)
    if not 0 < cfg.server.port < 65536:
        problems.append(f"--port {cfg.server.port}: must be 1-65535")
    if cfg.server.max_body_bytes < 1024:
        problems.append(f"--max-body-bytes {cfg.server.max_body_bytes}: must be >= 1024")
    if triton_problem := check_triton(cfg):
        problems.append(triton_problem)
    return problems


def _outside_roots(cfg: RuntimeConfig) -> list[str]:
    """With --allowed-local-roots: the model, the draft and every --lora adapter (each adapter
    file too) must resolve inside them, symlinks followed."""
    roots = cfg.server.allowed_local_roots
    if not roots:
        return []
    from .lora.sources import ADAPTER_FILES, SourceError, confine

    checks = [(f"--model {cfg.model.path}", cfg.model.path, ())]
    if cfg.speculative.enabled and cfg.speculative.draft_model_path:
        draft = cfg.speculative.draft_model_path
        checks.append((f"--draft-model {draft}", draft, ()))
    for name, path in cfg.lora.adapters.items():
        checks.append((f"--lora {name}={path} (lora_path)", path, ADAPTER_FILES))
    problems = []
    for subject, path, files in checks:
        try:
            confine(path, roots, subject=subject, files=files)
        except SourceError as exc:
            problems.append(str(exc))
    return problems


def check(cfg: RuntimeConfig):
    """Run the compatibility policy and the local checks.

    Returns ``(effective config or None, reasons to refuse, warnings)``.
    """
    from .contract.policy import check_config

    report = check_config(cfg)
    reasons = [v.render() for v in report.violations] + _local_checks(cfg)
    warnings = [w.render() for w in report.warnings]
    if report.resolution:
        warnings.insert(0, report.resolution)
    effective = report.effective if report.ok else None
    return effective, reasons, warnings


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraserve-runtime`` / ``python -m loraserve.runtime``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"loraserve-runtime: refusing to start: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    effective, reasons, warnings = check(cfg)
    for w in warnings:
        print(f"loraserve-runtime: warning: {w}", file=sys.stderr)
    if reasons:
        print(f"loraserve-runtime: refusing to start; {len(reasons)} problem(s):", file=sys.stderr)
        for r in reasons:
            print(f"  - {r}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        print(json.dumps(effective.to_dict(), indent=2, default=str))
        return 0
    return serve(effective, args)


async def _serve_until_signalled(app, host: str, port: int, drain_timeout_s: float) -> None:
    """Serve until SIGTERM/SIGINT, then drain with the listener still open, then stop.

    aiohttp's ``run_app`` closes the listening socket first, so probes and new requests
    would meet a refused connection while in-flight requests drain.
    """
    import signal

    from aiohttp import web

    from .server import drain

    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("%s again: ending the drain now", signal.Signals(signum).name)
            hurry.set()
        else:
            log.info("%s: draining (at most %.0f s)", signal.Signals(signum).name, drain_timeout_s)
            stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await web.TCPSite(runner, host, port).start()
        await stop.wait()
        await drain(app, drain_timeout_s, hurry=hurry)
    finally:
        await runner.cleanup()


def serve(cfg: RuntimeConfig, args: argparse.Namespace) -> int:
    """Run the HTTP server until SIGTERM/SIGINT; drain, then return 0."""

    from .engine.factory import build_engine
    from .lora.sources import SourceSettings
    from .server import STATE, build_app

    sources = SourceSettings(
        cache_dir=Path(cfg.server.adapter_cache_dir),
        pvc_root=Path(args.pvc_root),
        ca_file=args.adapter_ca_file,
    )
    if not cfg.server.allowed_local_roots:
        log.warning("--allowed-local-roots not given: adapter paths are not confined to any directory")
    app = build_app(
        cfg,
        lambda metrics: build_engine(cfg, observer=metrics),
        sources=sources,
        drain_timeout_s=args.drain_timeout,
        exit_on_load_failure=True,
    )
    log.info("listening on %s:%d (model %s)", cfg.server.host, cfg.server.port, cfg.model.path)
    asyncio.run(_serve_until_signalled(app, cfg.server.host, cfg.server.port, args.drain_timeout))
    state = app[STATE]
    if state.load_error:
        print(f"loraserve-runtime: the model failed to load: {state.load_error}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0
