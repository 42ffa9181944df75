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

``--scenario cluster`` runs the cluster-serving scenario of the end-to-end tests
(``tests/e2e/scenario.py``) instead: a 3-replica serve with 4 Adapters (one placed on 1
pod) under load through a Service stand-in (``tests/e2e/service.py``: a random Ready pod
per request, terminating pods for 1 s more, no retries, as kube-proxy) while a pod is deleted,
the serve scales 3 -> 4 -> 2 (scale subresource), a spec change rolls the pods and an
Adapter is created and another deleted. It reports the requests sent and failed (target
0), then, with the traffic stopped, the latency of the first request for an adapter on a
pod that does not hold it (an on-demand load; adapters placed on 1 pod, each asked once on
every other pod) and the time from an Adapter's creation until a request for it succeeds
on every ready pod, asked directly. Then, on a fresh 3-replica serve, what users do to
Adapters (``scenario.Operations``, the phases of ``tests/e2e/test_adapter_operations_e2e.py``)
behind a plain Service (a random Ready pod per request, terminating pods for 1 s, no
retries), each under its own load of 120-token streams: a version change in place, a scale
3 -> 1, a scale 1 -> 3 with an Adapter created while the new pods load their model, three
pods fetching one hf:// adapter into their shared cache at once, and a source that hangs.
It reports the failed requests per phase (target 0) and what each phase found wrong.

    python -P bench/operator.py                        # 20 iterations, 2 replicas
    python -P bench/operator.py --iterations 50 --out bench/results/$(date +%F)-operator-cpu.md
    python -P bench/operator.py --scenario cluster     # prints a markdown report
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import logging
import os
import platform
import runpy
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
# bench/harness.py, imported as bootstrap.py imports a benchmark (this file runs by its path)
harness = runpy.run_path(str(HERE / "bootstrap.py"))["import_module"]("harness")
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


async def _held_everywhere(http: aiohttp.ClientSession, pods, name: str) -> bool:
    """Every pod holds ``name`` loaded (``/v1/models`` also lists catalogued adapters not loaded yet)."""
    for pod in pods:
        async with http.get(f"http://{pod.ip}:{pod.port}/v1/models") as resp:
            entries = {entry["id"]: entry for entry in (await resp.json())["data"]}
        if name not in entries or (entries[name].get("lora") or {}).get("state", "loaded") != "loaded":
            return False
    return True


async def _first_success(
    http: aiohttp.ClientSession, pod, model: str, *, interval: float, timeout: float
) -> float:
    """Ask ``pod`` for ``model`` until it answers 200; the moment it did (monotonic)."""
    body = {"model": model, "prompt": "def main(", "max_tokens": 1, "temperature": 0}
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            async with http.post(f"http://{pod.ip}:{pod.port}/v1/completions", json=body) as resp:
                if resp.status == 200:
                    await resp.read()
                    return time.monotonic()
                last = f"{resp.status} {(await resp.text())[:200]}"
        except (aiohttp.ClientError, OSError) as exc:
            last = repr(exc)
        await asyncio.sleep(interval)
    raise TimeoutError(f"{model} not usable on {pod.name} within {timeout:g} s: {last}")


async def run_cluster(args: argparse.Namespace) -> dict:
    """The cluster-serving scenario under load, then the on-demand and creation timings."""
    cluster_mod = _load("cluster")
    assets = _load("assets")
    scenario_mod = _load("scenario")
    cache = assets.ensure_assets(REPO / ".cache" / "operator-e2e")
    work = Path(tempfile.mkdtemp(prefix="loraserve-bench-cluster-"))
    claims = assets.install_claims(cache, work / "claims")
    cluster = cluster_mod.Cluster(root=work, claims_root=claims.root)
    cluster.claims = claims
    await cluster.start()
    Plan = scenario_mod.AdapterPlan
    plans = [] if args.base_only else [
        Plan("alpha", "alpha"), Plan("beta", "beta"), Plan("gamma", "gamma"), Plan("delta", "delta", replicas=1)
    ]  # fmt: skip
    scn = scenario_mod.Scenario(cluster, NS, SERVE, say=lambda line: print(line, file=sys.stderr, flush=True))
    started = time.monotonic()
    result: dict = {"base_only": args.base_only}
    try:
        await cluster.start_operator(scenario_mod.operator_config())
        await scn.bring_up(3, plans)
        base = await scn.base_model()
        scn.start_traffic(
            [base, *(p.name for p in plans)], workers=args.workers, max_tokens=6, timeout_s=60, deadline_s=900
        )
        await scn.delete_pod()
        for replicas in (4, 2):
            await scn.scale(replicas)
        await scn.roll(6)
        moments: dict = {}
        if not args.base_only:
            moments = await scn.churn(Plan("omega", "alpha"), "gamma")
            await scn.hold(10)
        records = await scn.traffic.stop()
        outcome = scenario_mod.sort_records(
            records, created=None if args.base_only else "omega",
            deleted=None if args.base_only else "gamma", moments=moments,
        )  # fmt: skip
        result.update(
            records=records,
            outcome=outcome,
            steps=list(scn.steps),
            timeline=scn.timeline(),
            proxy_failures=list(scn.proxy.failures),
            traffic_s=scn.traffic.now(),
        )
        if not args.base_only:
            result.update(await _cluster_timings(scn, scenario_mod, args.adapters))
            result["operations"] = await _operations(cluster, scn, scenario_mod, args.workers)
    finally:
        await scn.stop()
        await cluster.stop()
    result["total_s"] = time.monotonic() - started
    result["load_average"] = os.getloadavg()
    return result


async def _operations(cluster, scn, scenario_mod, workers: int) -> list:
    """The adapter operations (issue 39) on a fresh serve, once the first one is deleted."""
    await cluster.delete(f"{scn.serves}/{SERVE}")
    ops = await scenario_mod.Operations.open(
        cluster,
        "bench-ops",
        "ops",
        say=lambda line: print(line, file=sys.stderr, flush=True),
        workers=workers,
    )
    try:
        return await ops.run_all()
    finally:
        await ops.close()


def operations_report(results: list) -> list[str]:
    """Markdown lines: the failed requests and the problems of each operation."""
    lines = [
        "",
        "Adapter operations, each under its own load (120-token greedy streams), behind a plain Service:",
        "",
        "| phase | requests | failed (target 0) | seconds | found |",
        "| --- | --- | --- | --- | --- |",
    ]
    for phase in results:
        found = "; ".join([*phase.notes, *(f"**{p}**" for p in phase.problems)]).replace("|", "/")
        lines.append(
            f"| {phase.name} | {len(phase.records) + len(phase.probes)} | **{len(phase.failed())}** "
            f"| {phase.seconds:.1f} | {found[:400]} |"
        )
    for phase in results:
        if phase.failed() or phase.problems:
            lines += ["", "```", phase.report(), "```"]
    return lines


async def _cluster_timings(scn, scenario_mod, count: int) -> dict:
    """First request on a pod without the adapter (on-demand), and creation -> usable everywhere.

    One Adapter at a time, each deleted (and gone) before the next, so every measurement
    starts from the same state and the pods' adapter slots never run out.
    """
    Plan = scenario_mod.AdapterPlan
    sources = ["alpha", "beta", "gamma", "delta"]
    replicas = len(scn.pods())
    on_demand: list[float] = []
    usable: list[float] = []

    async def remove(name: str) -> None:
        await scn.cluster.delete(f"{scn.adapters}/{name}")

        async def gone() -> bool:
            return await scn.cluster.get(f"{scn.adapters}/{name}") is None

        await scenario_mod.wait_for(gone, timeout=120, what=f"{name} deleted")
        scn.plans.pop(name, None)

    async with aiohttp.ClientSession() as http:
        for i in range(count):
            name = f"od{i:02d}"
            await scn.create_adapter(Plan(name, sources[i % len(sources)], replicas=1))
            await scn.wait_converged(replicas, what=f"{name} Ready")
            for pod in scn.ready_pods():
                if (await scn.catalog(pod))[name]["state"] == "loaded":
                    continue
                t0 = time.monotonic()
                on_demand.append(await _first_success(http, pod, name, interval=0.01, timeout=60) - t0)
            await remove(name)
        for i in range(count):
            name = f"new{i:02d}"
            await scn.wait_converged(replicas, what="converged")
            pods = scn.ready_pods()
            t0 = time.monotonic()
            await scn.create_adapter(Plan(name, sources[i % len(sources)]))
            done = await asyncio.gather(
                *(_first_success(http, pod, name, interval=0.02, timeout=60) for pod in pods)
            )
            usable.append(max(done) - t0)
            await remove(name)
    return {"on_demand": on_demand, "usable": usable, "timing_pods": replicas}


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
            f"| {label} | {len(values)} | {harness.percentile(values, 50):.3f} | {harness.percentile(values, 95):.3f} | "
            f"{min(values):.3f} | {max(values):.3f} | {statistics.mean(values):.3f} |"
        )
    p50 = harness.percentile(result["loaded"], 50)
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


def _stats(values: list[float]) -> str:
    if not values:
        return "| 0 | - | - | - | - |"
    return (
        f"| {len(values)} | {harness.percentile(values, 50):.3f} | {harness.percentile(values, 99):.3f} | {min(values):.3f} | "
        f"{max(values):.3f} |"
    )


def cluster_report(args: argparse.Namespace, result: dict) -> str:
    records, outcome = result["records"], result["outcome"]
    failed = outcome.failed()
    by_kind: dict[str, int] = {}
    for record in failed:
        key = f"{record.status} {record.proxy_error or record.error[:60]}"
        by_kind[key] = by_kind.get(key, 0) + 1
    deleted_after_404 = sum(r.status == 404 for r in outcome.deleted_after)
    latencies = [r.latency for r in records if r.ok]
    command = "python -P bench/operator.py --scenario cluster" + (" --base-only" if args.base_only else "")
    lines = [
        "# Operator: cluster serving under pod deletion, scaling, a rollout and adapter churn",
        "",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, no GPU  ",
        "Setup: real operator (kopf) against kmock's KubernetesEmulator (no API server exists here), a kubelet "
        "stand-in running real `loraserve-runtime` processes (tiny Llama, CPU) with graceful deletion (preStop, "
        "SIGTERM, SIGKILL after the grace period) and rolling updates (maxSurge 1, maxUnavailable 0), and a Service "
        "stand-in (a random Ready pod per request, terminating pods for 1 s more, no retries). "
        + (
            "Traffic to the base model only.  "
            if args.base_only
            else "4 Adapters (delta placed on 1 pod) and the base model, "
            f"{args.workers} concurrent clients, completions and chat, streamed and not, greedy, 6 tokens.  "
        ),
        f"Command: `{command}`",
        "",
        "| step | seconds to converge |",
        "| --- | --- |",
        *(f"| {label} | {took:.1f} |" for label, took in result["steps"]),
        "",
        f"- Requests sent: {len(records)} over {result['traffic_s']:.0f} s; failed: **{len(failed)}** (target 0)"
        + ("".join(f"; {n} x {kind}" for kind, n in sorted(by_kind.items())) if by_kind else "")
        + ".",
        f"- Latency of the successful requests: p50 {harness.percentile(latencies, 50):.3f} s, "
        f"p99 {harness.percentile(latencies, 99):.3f} s."
        if latencies
        else "- No successful request.",
    ]
    if not args.base_only:
        lines += [
            f"- Deleted adapter: {len(outcome.deleted_after)} requests after the Adapter was gone, "
            f"{deleted_after_404} answered 404; {len(outcome.deleted_window)} between its DELETE and then "
            f"(statuses {sorted({r.status for r in outcome.deleted_window}, key=str)}).",
            f"- Created adapter: {len(outcome.created_early)} requests before its status said Ready "
            f"(statuses {sorted({r.status for r in outcome.created_early}, key=str)}), "
            f"{len(outcome.created_ready)} after ({sum(not r.ok for r in outcome.created_ready)} failed).",
            "",
            f"With the traffic stopped, on {result['timing_pods']} pods:",
            "",
            "| measured | n | p50 s | p99 s | min s | max s |",
            "| --- | --- | --- | --- | --- | --- |",
            "| first request for an adapter on a pod that does not hold it (on-demand load) "
            + _stats(result["on_demand"]),
            "| Adapter created -> a request succeeds on every ready pod (asked directly) "
            + _stats(result["usable"]),
        ]
    if "operations" in result:
        lines += operations_report(result["operations"])
    lines += [
        "",
        f"- Whole run {result['total_s']:.0f} s; 1-minute load average at the end {result['load_average'][0]:.2f} "
        "(the operator, the stand-ins, the clients and every runtime share the machine's cores).",
    ]
    if failed:
        lines += ["", "Failed requests (first 20):", ""]
        lines += [f"- {r.describe()}" for r in failed[:20]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("adapter-load", "cluster"), default="adapter-load")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4, help="cluster: concurrent clients")
    parser.add_argument(
        "--adapters", type=int, default=6, help="cluster: adapters per timing (on-demand, creation)"
    )
    parser.add_argument("--base-only", action="store_true", help="cluster: traffic to the base model only")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a short run (adapter-load: 2 iterations, 1 warm-up; cluster: 2 adapters per timing)",
    )
    harness.add_output_args(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.iterations, args.warmup, args.adapters = 2, 1, 2
    if args.iterations < 1 or args.replicas < 1:
        parser.error("--iterations and --replicas must be >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.scenario == "cluster":
        result = asyncio.run(run_cluster(args))
        text = cluster_report(args, result)
        print(text)
        _write(args, text, result)
        phases = result.get("operations") or []
        return 1 if result["outcome"].failed() or any(p.failed() or p.problems for p in phases) else 0
    result = asyncio.run(run(args))
    text = report(args, result)
    print(text)
    _write(args, text, result)
    return 0


def _write(args: argparse.Namespace, text: str, result: dict) -> None:
    """The markdown to ``--out``, the run's numbers and environment as its JSON artifact."""
    record = {"scenario": args.scenario, "env": harness.environment("cpu"), **result}
    harness.write_report(text, record, out=args.out, json_to=args.json, name=f"operator-{args.scenario}")


if __name__ == "__main__":
    sys.exit(main())
