"""``loraserve-runtime``: flags -> ``RuntimeConfig`` -> compatibility check -> HTTP server.

Start-up refuses to run a configuration the compatibility policy
(``loraserve.runtime.contract.policy.check_config``) rejects, printing every reason at once, and
prints its warnings. The model then loads in the background while ``/health`` already
answers; ``/ready`` turns 200 once it serves. SIGTERM (and SIGINT) drain: the socket keeps
listening, ``/ready`` answers 503 and new requests 503 with ``Retry-After``, in-flight ones
get ``--drain-timeout`` seconds to finish (a second signal cuts the wait short); then those
that have not begun their answer get 503 ``shutting_down``, the rest are aborted, and the
process exits 0. Clients are held to the limits of :mod:`.server.limits` (header, body and
write timeouts, a connection cap below the file limit).
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
from .contract.config import FlagError, RuntimeConfig
from .contract.flags import add_arguments, config_from_namespace

log = logging.getLogger("loraserve.runtime")

EXIT_CONFIG = 2  # a bad flag or a configuration the policy refuses


# One error type for a flag value that cannot become a configuration (the contract's
# conversions raise it; the message names the flag).
ConfigError = FlagError


def build_parser() -> argparse.ArgumentParser:
    """Every configuration field's flag (generated from the config's fields), plus the
    flags of this process only: the admin token's file, where adapters come from, the
    drain, logging and ``--check-config``."""
    p = argparse.ArgumentParser(
        prog="loraserve-runtime",
        description="Serve one base model with many LoRA adapters (OpenAI-compatible API).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = add_arguments(p)["server"]
    g.add_argument(
        "--admin-token-file",
        default=None,
        help="file holding the bearer token of the admin routes (default: $LORASERVE_ADMIN_TOKEN; "
        "neither: admin routes are open)",
    )
    g.add_argument(
        "--pvc-root", default="/mnt/pvc", help="where pvc://<claim>/... adapter sources are mounted"
    )
    g.add_argument("--adapter-ca-file", default=None, help="extra CA bundle for https adapter sources")
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


def _config_json(model_dir: str | None) -> dict | None:
    """A model's config.json as an object, when readable (the start-up checks name what is not)."""
    if not model_dir:
        return None
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _architecture(raw: dict | None) -> str | None:
    """``architectures[0]`` of a config.json."""
    archs = raw.get("architectures") if raw is not None else None
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def _draft_block(raw: dict | None, draft_dir: str | None) -> int:
    """A DFLASH verify width when ``--num-draft-tokens`` is not given: the ``block_size`` the
    draft's config.json (``raw``) states, as the reference engine defaults it. A draft that
    states none verifies the reference's default block (``UNSTATED_BLOCK``), with a warning;
    one whose config.json cannot be read gets that too, and the start-up checks then name what
    is wrong."""
    from .speculative.dflash.format import UNSTATED_BLOCK, block_size_of

    if raw is None:
        return UNSTATED_BLOCK
    try:
        block = block_size_of(raw)
    except ValueError:  # a malformed block_size: the draft's loader refuses it by name
        return UNSTATED_BLOCK
    if block is None:
        log.warning("DFLASH draft %s states no block_size: verifying blocks of %d, the reference engine's "
                    "default; set --num-draft-tokens to the block it was trained on", draft_dir,
                    UNSTATED_BLOCK)  # fmt: skip
        return UNSTATED_BLOCK
    return block


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
    """The ``RuntimeConfig`` the flags describe (no validation beyond parsing), with what
    only this machine knows: architectures from the models' config.json, the admin token."""
    env = dict(os.environ) if env is None else env
    cfg = config_from_namespace(args)
    cfg.model.architecture = cfg.model.architecture or _architecture(_config_json(cfg.model.path))
    spec = cfg.speculative
    draft_raw = _config_json(spec.draft_model_path)  # read once for its architecture and block
    spec.draft_model_architecture = spec.draft_model_architecture or _architecture(draft_raw)
    if spec.num_draft_tokens is None:  # a DFLASH block not given (contract.config.default_draft_tokens)
        spec.num_draft_tokens = _draft_block(draft_raw, spec.draft_model_path)
    unknown_pins = sorted(set(cfg.lora.pinned) - set(cfg.lora.adapters))
    if unknown_pins:
        raise ConfigError(f"--pinned-loras {', '.join(unknown_pins)}: not given with --lora NAME=DIR")
    cfg.server.admin_token = _admin_token(args, env)
    if not cfg.server.allowed_local_roots:  # started by hand: confined to what the flags name
        from .lora.sources import default_local_roots

        cfg.server.allowed_local_roots = default_local_roots(cfg)
        log.info("--allowed-local-roots not given: local adapter paths must lie in %s",
                 ", ".join(cfg.server.allowed_local_roots))  # fmt: skip
    return cfg


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
    problems += _draft_layout_problems(cfg)
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


def _draft_layout_problems(cfg: RuntimeConfig) -> list[str]:
    """What the draft's config.json asks for that its drafter does not run (a multi-layer
    EAGLE head, a DSPARK draft under DFLASH...), judged before any weight loads."""
    from .contract.policy import resolve_algorithm
    from .contract.policy.drafts import draft_config_problems

    raw = _config_json(cfg.speculative.draft_model_path) if cfg.speculative.enabled else None
    if raw is None:
        return []
    algorithm, _ = resolve_algorithm(cfg)
    return [f"--draft-model {cfg.speculative.draft_model_path}: {p}" for p in draft_config_problems(algorithm, raw)]


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


EXIT_BIND = 3  # the listening address cannot be bound (port in use, no permission, bad host)


class BindError(OSError):
    """The listening address cannot be bound; the message names it and the fix."""


def _bind_listeners(host: str, port: int) -> list:
    """Bound, listening sockets for every address ``host`` resolves to (as asyncio's
    ``create_server`` binds them: SO_REUSEADDR, IPv6 sockets IPv6-only).

    Bound before the app starts, so a port in use fails at once, before the model loads
    and before "listening on" is logged. Raises :class:`BindError`.
    """
    import errno
    import socket

    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(
            f"cannot listen on {where}: host {host!r} does not resolve ({exc.strerror}): fix --host"
        ) from None
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _name, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(128)
    except OSError as exc:
        for sock in bound:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            fix = "the port is already in use: pass a free --port, or stop the process that holds it"
        elif exc.errno == errno.EACCES:
            fix = "permission denied (ports below 1024 need privileges): pass a --port of 1024 or above"
        elif exc.errno == errno.EADDRNOTAVAIL:
            fix = f"{host} is not an address of this machine: pass --host 0.0.0.0 or one of its addresses"
        else:
            fix = f"{exc.strerror or exc}: check --host and --port"
        raise BindError(f"cannot listen on {where}: {fix}") from None
    return bound


async def _serve_until_signalled(app, sockets: list, drain_timeout_s: float, limits) -> None:
    """Serve on already bound ``sockets`` within ``limits`` until SIGTERM/SIGINT, then drain
    with the listener still open, answer what is left 503 ``shutting_down``, then stop.

    aiohttp's ``run_app`` closes the listening socket first, so probes and new requests
    would meet a refused connection while in-flight requests drain.
    """
    import signal

    from .server import drain
    from .server.limits import FrontDoor, cut_off

    door = await FrontDoor.open(app, sockets, limits)
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
        await stop.wait()
        if not await drain(app, drain_timeout_s, hurry=hurry):
            cut_off(app)
    finally:
        await door.close()


def serve(cfg: RuntimeConfig, args: argparse.Namespace) -> int:
    """Bind, then run the HTTP server until SIGTERM/SIGINT; drain, then return 0.

    An address that cannot be bound returns ``EXIT_BIND`` with one line on stderr naming
    it and the fix, before the model loads and before "listening on" is logged.
    """

    from .builder import build_engine
    from .lora.sources import SourceSettings
    from .server import STATE, build_app
    from .server.limits import Limits

    try:
        sockets = _bind_listeners(cfg.server.host, cfg.server.port)
    except BindError as exc:
        print(f"loraserve-runtime: {exc}", file=sys.stderr)
        return EXIT_BIND
    sources = SourceSettings(
        cache_dir=Path(cfg.server.adapter_cache_dir),
        pvc_root=Path(args.pvc_root),
        ca_file=args.adapter_ca_file,
    )
    app = build_app(
        cfg,
        lambda metrics: build_engine(cfg, observer=metrics),
        sources=sources,
        drain_timeout_s=args.drain_timeout,
        exit_on_load_failure=True,
    )
    limits = Limits.from_config(cfg.server)
    log.info("listening on %s:%d (model %s)", cfg.server.host, cfg.server.port, cfg.model.path)
    log.info(
        "client limits: %d connections, header %g s, body %g s, write %g s, body %d bytes",
        limits.max_connections,
        limits.header_timeout_s,
        cfg.server.body_timeout_s,
        limits.write_timeout_s,
        cfg.server.max_body_bytes,
    )
    asyncio.run(_serve_until_signalled(app, sockets, args.drain_timeout, limits))
    state = app[STATE]
    if state.load_error:
        print(f"loraserve-runtime: the model failed to load: {state.load_error}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0
