"""``loraserve-distill-draft``: a draft LoRA distilled from the adapted target.

Every model is tiny and random (``loraserve.runtime.dev.devmodels``), built with a larger
``initializer_range`` than the default so the target's next-token distributions are peaked
enough for top-1 agreement to mean something. Three drafts:

- ``small``: ``build_draft_model``, a random smaller model with the target's tokenizer. It
  shares nothing with the random target, so a LoRA cannot make it agree (chance level):
  used where only the mechanics are tested (CLI, files, refusals).
- ``skip``: the target's first layer only (same embeddings and LM head), a stand-in for a
  draft trained to mimic the base target: it agrees partly, and distillation must raise it.
- ``copy``: the target itself (``copy_model``): the adapter's own delta is reachable by a
  draft LoRA on the same modules, so distillation must drive agreement close to 1.

The last test serves each written adapter as its Adapter's draft adapter through a real
engine (STANDALONE speculation, the draft's own pool) and checks the measured accept rate
rises with output unchanged.

Runs single-threaded: the tiny models are faster so, and CI runs suites side by side.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES
from loraserve.runtime.dev.devmodels import (
    ALL_LINEAR_MODULES,
    build_adapter,
    build_draft_model,
    build_tiny_model,
    copy_model,
)
from loraserve.runtime.tools.distill.corpus import CorpusError, pack, split_held_out
from loraserve.runtime.tools.distill.models import (
    DistillError,
    LoraSettings,
    check_vocabulary,
    load_tokenizer,
)
from loraserve.runtime.tools.distill.objective import kl_per_position
from loraserve.runtime.tools.distill.report import REPORT_FILE
from loraserve.runtime.tools.distill.train import TrainSettings, lr_factor
from loraserve.runtime.tools.distill_draft import DistillOptions, distill, main

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
SEQ_LEN = 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("distill")
    target = build_tiny_model(root / "target", seed=0, initializer_range=0.2)
    paths = {
        "target": target,
        "adapter-attn": build_adapter(
            root / "adapter-attn", target, target_modules=ATTENTION, seed=5, init_std=0.05
        ),
        "adapter-all": build_adapter(
            root / "adapter-all", target, target_modules=ALL_LINEAR_MODULES, seed=6, init_std=0.1
        ),
        "small": build_draft_model(root / "small", target),
        "copy": copy_model(target, root / "copy"),
    }
    # The layer-skip draft: the target cut to its first layer, saved as its own model.
    skip = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    skip.model.layers = skip.model.layers[:1]
    skip.config.num_hidden_layers = 1
    skip.save_pretrained(str(root / "skip"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(target / name, root / "skip" / name)
    paths["skip"] = root / "skip"
    # The corpus: Python source text, the kind the tiny tokenizer was trained on.
    corpus = root / "corpus.txt"
    corpus.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8"))
    paths["corpus"] = corpus
    return paths


def _options(models, tmp_path, draft: str, adapter: str, modules, steps: int, **training) -> DistillOptions:
    return DistillOptions(
        target=models["target"],
        adapter=models[adapter],
        draft=models[draft],
        corpus=[models["corpus"]],
        out=tmp_path / "out",
        lora=LoraSettings(rank=8, alpha=16, target_modules=tuple(modules)),
        training=TrainSettings(steps=steps, batch_size=4, lr=1e-2, **training),
        seq_len=SEQ_LEN,
        device="cpu",
        dtype="fp32",
    )


@pytest.fixture(scope="module")
def skip_run(models, tmp_path_factory):
    """One distillation of the layer-skip draft towards the all-linear adapter (shared by tests)."""
    tmp = tmp_path_factory.mktemp("skip-run")
    return distill(_options(models, tmp, "skip", "adapter-all", DEFAULT_LORA_MODULES, steps=150))


def test_distillation_lowers_kl(skip_run):
    """Distillation lowers KL and raises agreement."""
    before, after = skip_run.before, skip_run.after
    print(
        f"skip draft: KL {before.kl:.4f} -> {after.kl:.4f}, agreement {before.agreement:.2%} -> {after.agreement:.2%}"
    )
    assert before.positions == after.positions > 0
    assert after.kl < 0.8 * before.kl
    assert after.agreement > before.agreement + 0.05
    assert skip_run.stats.steps == 150 and skip_run.stats.tokens == 150 * 4 * SEQ_LEN


def test_written_adapter_loads(skip_run, models):
    """peft's default layout, no embedding copies, loaded by the runtime's loader; and peft
    reading it back onto the draft scores what the trained student scored."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraserve.runtime.lora.adapter import load_adapter
    from loraserve.runtime.model.arch import load_arch_config
    from loraserve.runtime.tools.distill.models import load_teacher
    from loraserve.runtime.tools.distill.objective import score

    out = skip_run.out
    assert {"adapter_config.json", "adapter_model.safetensors", REPORT_FILE} <= set(skip_run.files) | {
        REPORT_FILE
    }
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and not config.get("modules_to_save")
    assert sorted(config["target_modules"]) == sorted(DEFAULT_LORA_MODULES)
    weights = load_adapter(
        out,
        arch=load_arch_config(models["skip"]),
        max_rank=8,
        pool_modules=DEFAULT_LORA_MODULES,
        dtype=torch.float32,
    )
    assert weights.rank == 8 and weights.scaling == 2.0
    assert set(weights.target_modules) == set(DEFAULT_LORA_MODULES)
    assert {layer for _, layer in weights.weights} == {0}
    assert any(
        float(b.abs().max()) > 0 for _, b in weights.weights.values()
    )  # trained: lora_B moved off zero

    draft = AutoModelForCausalLM.from_pretrained(str(models["skip"]), dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(draft, str(out)).eval()
    teacher = load_teacher(models["target"], models["adapter-all"], torch.float32, "cpu")
    from loraserve.runtime.tools.distill.corpus import load_corpus

    corpus = load_corpus([models["corpus"]], load_tokenizer(models["target"]), SEQ_LEN, seed=0)
    again = score(teacher, reloaded, corpus.held_out, 512, batch_size=4, device="cpu")
    assert again.agreement == pytest.approx(skip_run.after.agreement)
    assert again.kl == pytest.approx(skip_run.after.kl, rel=1e-4)
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["after"]["agreement"] == pytest.approx(skip_run.after.agreement)


@pytest.fixture(scope="module")
def copy_run(models, tmp_path_factory):
    """The draft is the target and the draft LoRA covers the adapter's modules at its rank."""
    tmp = tmp_path_factory.mktemp("copy-run")
    return distill(_options(models, tmp, "copy", "adapter-attn", ATTENTION, steps=300))


def test_a_copy_of_the_target_learns_the_adapter(copy_run):
    """The adapter itself is a solution, and distillation gets close to it."""
    before, after = copy_run.before, copy_run.after
    print(
        f"copy draft: KL {before.kl:.4f} -> {after.kl:.4f}, agreement {before.agreement:.2%} -> {after.agreement:.2%}"
    )
    assert before.agreement < 0.75  # the adapter moved the target: the unadapted copy disagrees often
    assert after.agreement > 0.9
    assert after.kl < 0.05 * before.kl


def test_cli_prints_the_report(models, tmp_path, capsys):
    out = tmp_path / "draft-adapter"
    rc = main(
        [
            "--target", str(models["target"]),
            "--adapter", str(models["adapter-attn"]),
            "--draft", str(models["small"]),
            "--corpus", str(models["corpus"]),
            "--out", str(out),
            "--rank", "4", "--alpha", "8", "--target-modules", "q_proj,v_proj",
            "--steps", "5", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-3",
            "--top-k", "16", "--device", "cpu", "--dtype", "fp32", "--seed", "3",
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "draft LoRA r=4 alpha=8 on q_proj,v_proj: 5 steps in" in captured.out
    assert "KL(adapted target || draft)" in captured.out and "top-1 agreement" in captured.out
    assert "read back by the runtime's adapter loader" in captured.out
    assert "step 5/5" in captured.err  # progress on stderr
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["training"]["top_k"] == 16 and report["lora"]["target_modules"] == ["q_proj", "v_proj"]

    # A second run into the same folder is refused unless asked for.
    rc = main([*_minimal_args(models, out), "--steps", "1"])
    assert rc == 2 and "is not empty" in capsys.readouterr().err
    assert main([*_minimal_args(models, out), "--steps", "1", "--overwrite", "--rank", "32"]) == 0
    # A rank above the draft pool's default is written, and the report says what to set.
    assert "speculative.draftLora.maxRank (--draft-max-lora-rank) of at least 32" in capsys.readouterr().out


def _minimal_args(models, out: Path, **replace: str) -> list[str]:
    args = {
        "--target": str(models["target"]),
        "--adapter": str(models["adapter-attn"]),
        "--draft": str(models["small"]),
        "--corpus": str(models["corpus"]),
        "--out": str(out),
    }
    args.update(replace)
    flat = [item for pair in args.items() for item in pair]
    return [*flat, "--seq-len", "16", "--batch-size", "2", "--device", "cpu", "--quiet"]


def test_help_says_what_kinds_of_draft_it_distils(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "STANDALONE" in text and "EAGLE" in text and "--top-k" in text


def test_other_tokenizer_refused(models, tmp_path, capsys):
    """A draft with another tokenizer is refused."""
    other = build_tiny_model(tmp_path / "other", vocab_size=300, seed=9)
    rc = main(_minimal_args(models, tmp_path / "out", **{"--draft": str(other)}))
    err = capsys.readouterr().err
    assert rc == 2
    assert "different tokenizer vocabulary" in err and "300 vs 512 tokens" in err
    assert "must use the target's tokenizer" in err and "EAGLE / NGRAM" in err
    assert not (tmp_path / "out").exists()


def test_padded_vocab_common_width(models, tmp_path):
    """A padded draft vocabulary is compared over the common width."""
    padded = build_tiny_model(tmp_path / "padded", vocab_size=520, tokenizer_from=models["target"], seed=4)
    tok = load_tokenizer(models["target"])
    vocab = check_vocabulary(models["target"], padded, tok, load_tokenizer(padded))
    assert (vocab.width, vocab.target_size, vocab.draft_size, vocab.tokenizer_checked) == (
        512,
        512,
        520,
        True,
    )


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        ({"--corpus": "/nonexistent/corpus.txt"}, "corpus file '/nonexistent/corpus.txt' does not exist"),
        ({"--corpus": "{tmp}"}, "is a directory: give the text files themselves"),
        ({"--draft": "{tmp}/nothing"}, "--draft '{tmp}/nothing' is not a directory"),
        ({"--adapter": "{tmp}"}, "has no adapter_config.json"),
    ],
)
def test_bad_paths_are_refused_by_name(models, tmp_path, capsys, replace, message):
    replace = {k: v.format(tmp=tmp_path) for k, v in replace.items()}
    assert main(_minimal_args(models, tmp_path / "out", **replace)) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_bad_corpus_text_and_settings_are_refused(models, tmp_path, capsys):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 ".encode("latin-1") * 50)
    assert main(_minimal_args(models, tmp_path / "o1", **{"--corpus": str(latin1)})) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("def f(): pass\n")
    assert main(_minimal_args(models, tmp_path / "o2", **{"--corpus": str(tiny)})) == 2
    assert "at least 2 are needed" in capsys.readouterr().err
    assert main([*_minimal_args(models, tmp_path / "o3"), "--target-modules", "q_proj,qkv_proj"]) == 2
    assert "--target-modules has ['qkv_proj']" in capsys.readouterr().err


def test_unroll_refused_standalone(models, tmp_path, capsys):
    """Unroll is checked and refused for a standalone draft."""
    assert main([*_minimal_args(models, tmp_path / "o1"), "--unroll", "0"]) == 2
    err = capsys.readouterr().err
    assert "--unroll must be a positive integer, got 0" in err and "give 1" in err
    assert main([*_minimal_args(models, tmp_path / "o2"), "--unroll", "2"]) == 2
    err = capsys.readouterr().err
    assert "--unroll 2 applies to EAGLE / EAGLE3 heads only" in err and "leave --unroll out" in err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_kl_matches_definition():
    """KL matches its definition and top k covers the full case."""
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 10), torch.randn(2, 3, 12) * 3  # teacher wider: padded rows
    ours = kl_per_position(student, teacher, 10, temperature=2.0)
    p = torch.log_softmax(teacher[..., :10] / 2.0, -1)
    q = torch.log_softmax(student / 2.0, -1)
    reference = torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(kl_per_position(student, teacher, 10, temperature=2.0, top_k=10), ours)
    truncated = kl_per_position(student, teacher, 10, top_k=3)
    assert truncated.shape == (2, 3) and torch.isfinite(truncated).all()


def test_packing_split_and_schedule():
    sequences = pack([[1, 2, 3, 4, 5], [1, 6, 7, 8, 9, 10, 11]], 4)
    assert sequences.tolist() == [[1, 2, 3, 4], [5, 1, 6, 7], [8, 9, 10, 11]]
    train, held = split_held_out(torch.arange(40).view(40, 1), seed=1)
    assert held.shape[0] == 2 and train.shape[0] == 38
    assert set(train.flatten().tolist()).isdisjoint(held.flatten().tolist())
    assert torch.equal(held, split_held_out(torch.arange(40).view(40, 1), seed=1)[1])
    with pytest.raises(CorpusError, match="at least 2"):
        split_held_out(torch.zeros(1, 4, dtype=torch.int64))
    factors = [lr_factor(step, 100) for step in range(100)]
    assert factors[0] == pytest.approx(0.2) and max(factors) == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1, abs=0.01) and factors[10] > factors[50] > factors[90]


def test_lora_refuses_unwrapped_modules():
    """LoRA settings refuse modules the draft pool does not wrap."""
    with pytest.raises(DistillError, match="short names"):
        LoraSettings(target_modules=("model.layers.0.q_proj",)).check()
    with pytest.raises(DistillError, match="never embed_tokens or lm_head"):
        LoraSettings(target_modules=("q_proj", "lm_head")).check()
    LoraSettings().check()


def _serve(models, requests, draft: str, adapter: str, draft_adapter: Path | None):
    """Run ``requests`` through a real engine: STANDALONE speculation with ``draft``, the
    ``sql`` Adapter being ``adapter``, the draft's own pool holding ``draft_adapter`` for it."""
    import threading

    from loraserve.runtime.contract.config import LORA_MODULES, RuntimeConfig, SpecAlgorithm
    from loraserve.runtime.engine.engine import Engine
    from loraserve.runtime.engine.request import Request
    from loraserve.runtime.runner.model_runner import ModelRunner
    from loraserve.runtime.speculative import build_decoder

    config = RuntimeConfig()
    config.model.path = str(models["target"])
    config.device = "cpu"
    config.scheduler.max_total_tokens = 4096
    config.scheduler.max_running_requests = len(requests)
    config.lora.max_rank = 8
    config.lora.target_modules = LORA_MODULES
    config.lora.backend = "torch"
    config.lora.adapters = {"sql": str(models[adapter])}
    config.speculative.algorithm = SpecAlgorithm.STANDALONE
    config.speculative.draft_model_path = str(models[draft])
    config.speculative.num_steps, config.speculative.num_draft_tokens = 3, 4
    config.speculative.draft_max_loras = 1
    config.speculative.draft_max_lora_rank = 8
    engine = Engine(config, ModelRunner(config), decoder_factory=build_decoder)
    engine.refresh_adapters()
    if draft_adapter is not None:
        engine.decoder.drafter.lora.load("sql", draft_adapter)
    outputs: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    finished, lock, done = set(), threading.Lock(), threading.Event()

    def sink_for(rid):
        def sink(out):
            with lock:
                outputs[rid].extend(out.token_ids)
                if out.finished:
                    assert out.error is None, out.error
                    finished.add(rid)
                    if len(finished) == len(requests):
                        done.set()

        return sink

    engine.start()
    try:
        for rid, prompt, params in requests:
            engine.submit(
                Request(rid=rid, prompt_ids=prompt, params=params, adapter="sql", sink=sink_for(rid))
            )
        assert done.wait(120), "requests still pending"
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    stats = engine.decoder.metrics.snapshot().per_adapter["sql"]
    return outputs, stats.accepted_tokens / stats.draft_tokens


@pytest.mark.parametrize(
    ("draft", "adapter", "run"), [("skip", "adapter-all", "skip_run"), ("copy", "adapter-attn", "copy_run")]
)
def test_distilled_adapter_raises_accept(draft, adapter, run, models, request):
    """End to end: the runtime serves the written adapter as the Adapter's draft adapter;
    greedy output is unchanged and the measured accept rate rises."""
    from loraserve.runtime.sampling import SamplingParams
    from loraserve.runtime.tools.distill.corpus import load_corpus

    report = request.getfixturevalue(run)
    corpus = load_corpus([models["corpus"]], load_tokenizer(models["target"]), SEQ_LEN, seed=0)
    requests = [
        (f"r{i}", corpus.held_out[i, :12].tolist(), SamplingParams(max_tokens=16, temperature=0.0))
        for i in range(min(8, corpus.held_out.shape[0]))
    ]
    plain, rate_before = _serve(models, requests, draft, adapter, None)
    adapted, rate_after = _serve(models, requests, draft, adapter, report.out)
    print(f"{draft} draft, served accept rate: {rate_before:.2%} -> {rate_after:.2%}")
    assert adapted == plain  # output never depends on the draft
    assert rate_after > rate_before
    if draft == "copy":
        assert rate_after > 0.7  # 39% -> 82% when written
