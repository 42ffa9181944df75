"""Adapter time-to-serve: from creating an Adapter to it being Loaded on every ready pod.

Runs the real operator (kopf, in-process) against the test stand-in cluster: kmock's
KubernetesEmulator for the API (no API server exists on these machines) and a kubelet
stand-in that runs one real ``loraserve-runtime`` process per replica (tiny model, CPU).
A LoRAServe with ``--replicas`` pods is brought up once; then, ``--iterations`` times, an
Adapter is created through the API and two moments are timed from that POST:

* loaded: every ready pod lists the adapter in ``GET /v1/models`` (polled every 10 ms);
* reported: the Adapter's status says ``phase: Ready`` with every pod Loaded.

Each Adapter is deleted (and unloaded) before the next, so every run loads into the same
state. No device is needed.

    python -P bench/operator.py                        # 20 iterations, 2 replicas
    python -P bench/operator.py --iterations 50 --out bench/results/$(date +%F)-operator-cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The repository's operator/ folder must not shadow the standard library's `operator`.
HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path.pop(0)

import aiohttp  # noqa: E402

from loraserve.operator.config import OperatorConfig  # noqa: E402

REPO = HERE.parent
E2E = REPO / "tests" / "e2e"
TARGET_P50_S = 2.0
NS, SERVE = "bench", "tiny"


def _load(name: str):
    module_name = f"_loraserve_e2e_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, E2E / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def _held_everywhere(http: aiohttp.ClientSession, pods, name: str) -> bool:
    for pod in pods:
        async with http.get(f"http://{pod.ip}:{pod.port}/v1/models") as resp:
            ids = {entry["id"] for entry in (await resp.json())["data"]}
        if name not in ids:
            return False
    return True


async def run(args: argparse.Namespace) -> dict:
    cluster_mod = _load("cluster")
    assets = _load("assets")
    wait_for = cluster_mod.wait_for
    cache = assets.ensure_assets(REPO / ".cache" / "operator-e2e")
    work = Path(tempfile.mkdtemp(prefix="loraserve-bench-operator-"))
    claims = assets.install_claims(cache, work / "claims")
    cluster = cluster_mod.Cluster(root=work, claims_root=claims.root)
    await cluster.start()
    serves = cluster_mod.SERVES.format(ns=NS)
    adapters = cluster_mod.ADAPTERS.format(ns=NS)
    loaded: list[float] = []
    reported: list[float] = []
    started = time.monotonic()
    try:
        config = OperatorConfig(webhook_enabled=False, resync_interval_s=30.0)
        await cluster.start_operator(config)
        await cluster.create(
            serves, assets.serve_manifest(SERVE, claims, replicas=args.replicas, namespace=NS)
        )

        async def serve_running() -> bool:
            body = await cluster.get(f"{serves}/{SERVE}")
            return ((body or {}).get("status") or {}).get("phase") == "Running"

        await wait_for(serve_running, timeout=180, interval=0.2, what="serve Running")
        bring_up = time.monotonic() - started
        pods = cluster.kubelet.pods_of(NS, SERVE)
        # The stand-in's polling shares the two cores with everything timed: slow it down.
        cluster.kubelet.tick_s = 1.0
        sources = ["alpha", "beta", "gamma", "delta"]
        async with aiohttp.ClientSession() as http:
            for i in range(args.warmup + args.iterations):
                name = f"a{i:03d}"
                manifest = assets.adapter_manifest(
                    name, SERVE, f"pvc://adapters/{sources[i % len(sources)]}", namespace=NS
                )
                t0 = time.monotonic()
                await cluster.create(adapters, manifest)
                await wait_for(
                    lambda n=name: _held_everywhere(http, pods, n),
                    timeout=60,
                    interval=0.01,
                    what=f"{name} loaded",
                )
                t_loaded = time.monotonic() - t0

                async def ready(n: str = name) -> bool:
                    status = ((await cluster.get(f"{adapters}/{n}")) or {}).get("status") or {}
                    states = [p["state"] for p in status.get("pods") or []]
                    return status.get("phase") == "Ready" and states == ["Loaded"] * len(pods)

                await wait_for(ready, timeout=60, interval=0.01, what=f"{name} Ready")
                t_reported = time.monotonic() - t0
                if i >= args.warmup:
                    loaded.append(t_loaded)
                    reported.append(t_reported)
                await cluster.delete(f"{adapters}/{name}")

                async def gone(n: str = name) -> bool:
                    return await cluster.get(f"{adapters}/{n}") is None and not await _held_everywhere(
                        http, pods[:1], n
                    )

                await wait_for(gone, timeout=60, interval=0.02, what=f"{name} deleted")
        loads_sent = sum(cluster.operator.context.counters.loads.values())
    finally:
        await cluster.stop()
    return {
        "load_average": os.getloadavg(),
        "loaded": loaded,
        "reported": reported,
        "bring_up_s": bring_up,
        "pods": len(pods),
        "loads_sent": loads_sent,
        "total_s": time.monotonic() - started,
    }


def report(args: argparse.Namespace, result: dict) -> str:
    rows = []
    for label, values in (
        ("loaded on every ready pod", result["loaded"]),
        ("status Ready", result["reported"]),
    ):
        rows.append(
            f"| {label} | {len(values)} | {percentile(values, 50):.3f} | {percentile(values, 95):.3f} | "
            f"{min(values):.3f} | {max(values):.3f} | {statistics.mean(values):.3f} |"
        )
    p50 = percentile(result["loaded"], 50)
    verdict = "met" if p50 < TARGET_P50_S else "**not met**"
    expected_loads = (args.warmup + args.iterations) * result["pods"]
    lines = [
        "# Operator: Adapter creation to Loaded on every ready pod",
        "",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, no GPU  ",
        f"Setup: real operator (kopf) against kmock's KubernetesEmulator (no API server exists here) and a kubelet "
        f"stand-in running {result['pods']} real `loraserve-runtime` processes (tiny Llama, CPU); rank 4-8 PEFT "
        f"adapters from a volume claim; {args.warmup} warm-up + {args.iterations} timed Adapters, each deleted "
        "before the next; times from the Adapter's POST, polled every 10 ms  ",
        f"Command: `python -P bench/operator.py --iterations {args.iterations} --replicas {args.replicas}`",
        "",
        "| moment | n | p50 s | p95 s | min s | max s | mean s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"- Target p50 < {TARGET_P50_S:g} s (loaded on every ready pod): {verdict} ({p50:.3f} s).",
        f"- Load requests sent by the operator: {result['loads_sent']} for {expected_loads} adapter-pod pairs "
        "(one each: GET /v1/models first, never a repeated load).",
        f"- Serve bring-up (LoRAServe created to Running, runtime processes started): {result['bring_up_s']:.1f} s; "
        f"whole run {result['total_s']:.1f} s.",
        "- The operator, the API stand-in, the kubelet stand-in and both runtimes share the machine's cores; "
        f"1-minute load average at the end: {result['load_average'][0]:.2f} (other work on the machine counts too). "
        "The spread is mostly that contention (the fastest runs, min above, show the uncontended path).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.replicas < 1:
        parser.error("--iterations and --replicas must be >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = asyncio.run(run(args))
    text = report(args, result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
