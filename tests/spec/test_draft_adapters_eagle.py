"""Draft adapters for EAGLE / EAGLE3 heads: a request drafts with its Adapter's head adapter.

Oracles, through a real engine on the CPU:

- lossless: output with speculation and head draft adapters = output without speculation,
  per adapter, in one mixed batch (adapters with a head adapter, one without, the base
  model), chains and trees, EAGLE and EAGLE3, eager and through the graph runner's static
  path (padded batches, the LoRA layouts in fixed buffers);
- isolation: a head adapter changes only its own requests' proposals; every other request's
  head output is bit-identical to the unadapted head's;
- effect: on a head that IS the target's (single) layer, a head adapter equal to the
  target's adapter accepts every greedy draft, and one DISTILLED by
  ``loraserve-distill-draft`` lifts the accept rate above the shared head's; with the lease
  ignored (every request drafting unadapted) the lift is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from loraserve.runtime.contract.config import RuntimeConfig, SpecAlgorithm
from loraserve.runtime.lora import AdapterError
from loraserve.runtime.sampling import SamplingParams
from loraserve.runtime.speculative.draft_adapters import DraftAdapterLeases
from loraserve.runtime.speculative.eagle.builder import build_eagle_draft, build_eagle_draft_adapter
from loraserve.runtime.speculative.eagle.graphs import EagleGraphRunner
from loraserve.runtime.speculative.eagle.lora import HEAD_LORA_MODULES
from loraserve.runtime.speculative.eagle.runner import EagleDraftRunner
from loraserve.runtime.speculative.metrics import BASE_LABEL
from loraserve.runtime.speculative.tree import TreeShape

from .conftest import eagle_runner, tiny_target

HEADS = {"eagle": ("EAGLE", 1), "eagle3": ("EAGLE3", 3)}
TREE = {"top_k": 2, "num_steps": 3, "num_draft_tokens": 8}
DRAFTED = ("attn-r8", "all-r16")  # Adapters with a head draft adapter; mlp-r4 and the base without


@pytest.fixture(scope="module")
def head_adapters(spec_assets, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Random head draft adapters (both LoRA factors random: they move proposals) per head."""
    root = tmp_path_factory.mktemp("head_adapters")
    paths = {"eagle": spec_assets.eagle, "eagle3": spec_assets.eagle3}
    return {
        head: {
            name: build_eagle_draft_adapter(
                root / head / name, paths[head], rank=8, seed=40 + i, init_std=0.15
            )
            for i, name in enumerate(DRAFTED)
        }
        for head in HEADS
    }


def _requests(max_tokens: int = 12):
    prompts = [
        [5, 9, 33, 7, 81, 4],
        [12, 400, 77, 3],
        [66, 67, 68, 69, 70, 71, 72],
        [8, 8, 9, 9, 10],
        [301, 7, 7],
    ]
    names = ["attn-r8", "all-r16", "mlp-r4", None, "attn-r8"]
    return [
        (f"r{i}", prompt, SamplingParams(max_tokens=max_tokens - i % 3, temperature=0.0), names[i])
        for i, prompt in enumerate(prompts)
    ]


@pytest.fixture(scope="module")
def expected(make_spec_config, engine_run):
    run = engine_run(make_spec_config(), _requests())
    return {rid: run.outputs[rid].tokens for rid, *_ in _requests()}


def _head_config(make_spec_config, head: str, *, tree: bool, pool: int = 2):
    algorithm, _ = HEADS[head]
    config = make_spec_config(algorithm, head, max_running_requests=8)
    config.speculative.draft_max_loras = pool
    config.speculative.draft_max_lora_rank = 16
    if tree:
        spec = config.speculative
        spec.top_k, spec.num_steps, spec.num_draft_tokens = (
            TREE["top_k"],
            TREE["num_steps"],
            TREE["num_draft_tokens"],
        )
    return config


def _loading(adapters: dict[str, Path], *, static_path: bool = False):
    def hook(decoder):
        runner = decoder.drafter.runner
        assert runner.lora is not None and runner.lora.list() == []  # the target's adapters stay out
        for name, path in adapters.items():
            runner.lora.load(name, path)
        if static_path:  # the graph runner's padded static path, run eagerly on the CPU
            runner.graphs = EagleGraphRunner(runner, max_bs=4, use_graphs=False)

    return hook


@pytest.mark.parametrize("static_path", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("head", list(HEADS))
def test_head_adapters_lossless_mixed(
    make_spec_config, engine_run, head_adapters, expected, head, shape, static_path
):
    """Head draft adapters are lossless in mixed batches."""
    config = _head_config(make_spec_config, head, tree=shape == "tree")
    run = engine_run(config, _requests(), decoder_hook=_loading(head_adapters[head], static_path=static_path))
    for rid, *_ in _requests():
        assert run.outputs[rid].error is None, rid
        assert run.outputs[rid].tokens == expected[rid], rid
    pool = run.engine.draft_pool
    placed = {info.name: info for info in pool.list()}
    assert set(placed) == set(DRAFTED)
    # Both were placed in a slot by a draft forward, and every lease was released.
    assert all(info.slot is not None and info.refcount == 0 for info in placed.values())
    if static_path:  # the verify's feed and the next proposal ran as one padded replay, adapted
        graphs = run.engine.decoder.drafter.runner.graphs
        fed = graphs._trees if shape == "tree" else graphs._feed_chains
        assert graphs._adapted.get(id(fed)), "no adapted feed-and-propose replay ran"


def test_excess_head_adapters_draft(
    make_spec_config, engine_run, head_adapters, expected, caplog
):
    """Two drafted Adapters in one batch, one draft slot: one drafts with its head adapter,
    the other unadapted for that forward, instead of a failed draft step (which would retry
    the batch request by request)."""
    config = _head_config(make_spec_config, "eagle", tree=False, pool=1)
    with caplog.at_level("ERROR"):
        run = engine_run(config, _requests(), decoder_hook=_loading(head_adapters["eagle"]))
    for rid, *_ in _requests():
        assert run.outputs[rid].error is None and run.outputs[rid].tokens == expected[rid], rid
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    assert any(info.slot is not None for info in run.engine.draft_pool.list())


# --------------------------------------------------------------------------- runner level


def head_runners(
    spec_assets,
    head: str,
    adapter: Path,
    *,
    device: str = "cpu",
    use_graphs: bool = False,
    backend: str = "torch",
):
    """The same head three times: unadapted, with a pool (eager), with a pool through the
    graph runner (batches padded to 4; ``use_graphs=False``: its static path, run eagerly)."""
    path = {"eagle": spec_assets.eagle, "eagle3": spec_assets.eagle3}[head]
    arch, target = tiny_target(spec_assets, device)
    pool = RuntimeConfig().speculative
    pool.draft_max_loras, pool.draft_max_lora_rank = 2, 16
    lora = RuntimeConfig().lora
    lora.backend = backend

    def make(with_pool: bool) -> EagleDraftRunner:
        runner = eagle_runner(
            path, arch, target, device, draft_lora=pool.draft_lora_pool(lora) if with_pool else None
        )
        if with_pool:
            runner.lora.load("x", adapter)
        return runner

    plain, eager, graphed = make(False), make(True), make(True)
    graphed.graphs = EagleGraphRunner(graphed, max_bs=4, use_graphs=use_graphs)
    return plain, eager, graphed


def check_head_adapter_proposals(plain, eager, graphed, device: str, *, exact: bool = True) -> None:
    """Requests a and c draft with adapter ``x``, b without, through ``graphed`` (padded to 4)
    and ``eager``: the same features and proposals (chains and trees); b's are the plain
    head's (bit-identical features where ``exact``), a's and c's are not."""
    gen = torch.Generator().manual_seed(3)
    lens = [7, 5, 9]
    rids, names = ["a", "b", "c"], ["x", None, "x"]
    ids = torch.randint(3, 500, (sum(lens),), generator=gen).to(device)
    feats = torch.randn(sum(lens), plain.model.feature_size, generator=gen).to(device)
    base = plain.forward(rids, ids, feats, lens)
    outs = [r.forward(rids, ids, feats, lens, lora_names=names) for r in (eager, graphed)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # both ragged, so both eager
    spans = {"a": slice(0, 7), "b": slice(7, 12), "c": slice(12, 21)}
    if exact:
        assert torch.equal(outs[0][spans["b"]], base[spans["b"]])  # bit-identical: no adapter on b
    for rid in ("a", "c"):
        assert not torch.allclose(outs[0][spans[rid]], base[spans[rid]], atol=1e-3)
    last = torch.tensor([6, 11, 20], device=device)
    tails = {"base": base[last], "adapted": outs[0][last]}

    # Chains: one replay of 3 requests padded to 4, against eager single steps.
    chain = graphed.draft_chain(rids, tails["adapted"], 4, lora_names=names)
    want, hidden = [eager.compute_logits(tails["adapted"]).argmax(-1)], tails["adapted"]
    base_hidden, base_want = tails["base"], [plain.compute_logits(tails["base"]).argmax(-1)]
    for _ in range(3):
        hidden, logits = eager.step(rids, want[-1], hidden, lora_names=names)
        want.append(logits.argmax(-1))
        base_hidden, logits = plain.step(rids, base_want[-1], base_hidden)
        base_want.append(logits.argmax(-1))
    assert torch.equal(chain, torch.stack(want, 1))
    assert torch.equal(chain[1], torch.stack(base_want, 1)[1])  # b proposes what the plain head does
    assert not torch.equal(chain[[0, 2]], torch.stack(base_want, 1)[[0, 2]])

    # Trees from the same tails: graphed (padded) = eager; b's tree is the plain head's.
    for r in (plain, eager, graphed):
        for rid in rids:
            r.kv.truncate(rid, 3)  # the chain's entries
    shape = TreeShape(2, 3, 8)
    trees = [
        graphed.draft_tree(rids, tails["adapted"], shape, lora_names=names),
        eager.draft_tree(rids, tails["adapted"], shape, lora_names=names),
    ]
    plain_tree = plain.draft_tree(rids, tails["base"], shape)
    for mine, theirs in zip(trees[0].tensors(), trees[1].tensors(), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(trees[0].tokens[1], plain_tree.tokens[1])
    assert not torch.equal(trees[0].tokens[0], plain_tree.tokens[0])

    # Requests with an unadapted history (the same cache entries and tails in every runner):
    # from those tails a tree's first level and a chain's first token are the plain head's (the
    # LM head is shared and unadapted); what the draft steps grow differs only where the
    # adapter runs in them.
    fresh = ["d", "e", "f"]
    tail = plain.forward(fresh, ids, feats, lens)[last]
    plain_tree = plain.draft_tree(fresh, tail, shape)
    for rid in fresh:
        plain.kv.truncate(rid, shape.entries)
    plain_chain = [plain.compute_logits(tail).argmax(-1)]
    hidden = tail
    for _ in range(3):
        hidden, logits = plain.step(fresh, plain_chain[-1], hidden)
        plain_chain.append(logits.argmax(-1))
    plain_chain = torch.stack(plain_chain, 1)
    for runner in (graphed, eager):
        runner.forward(fresh, ids, feats, lens)
        grown = runner.draft_tree(fresh, tail, shape, lora_names=names)
        for i in range(3):
            assert _level_one(grown, i) == _level_one(plain_tree, i)
        assert torch.equal(grown.tokens[1], plain_tree.tokens[1])
        assert not torch.equal(grown.tokens[[0, 2]], plain_tree.tokens[[0, 2]])
        for rid in fresh:
            runner.kv.truncate(rid, shape.entries)
        chain = runner.draft_chain(fresh, tail, 4, lora_names=names) if runner is graphed else None
        if chain is not None:
            assert torch.equal(chain[:, 0], plain_chain[:, 0]) and torch.equal(chain[1], plain_chain[1])
            assert not torch.equal(chain[[0, 2], 1:], plain_chain[[0, 2], 1:])
    assert graphed.graphs.num_shapes >= 2 and eager.lora.list()[0].refcount == 0


def _level_one(tree, row: int) -> list[int]:
    """The tokens a request's tree proposes right after its root (from its tail's logits)."""
    return sorted(tree.tokens[row][tree.depths[row] == 1].tolist())


@pytest.mark.parametrize("head", list(HEADS))
def test_head_adapter_own_requests_only(spec_assets, head_adapters, head):
    """A head adapter changes only its own requests."""
    runners = head_runners(spec_assets, head, head_adapters[head]["attn-r8"])
    check_head_adapter_proposals(*runners, "cpu")


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton LoRA kernels need CUDA or TRITON_INTERPRET=1 (make test sets it)",
)
def test_triton_head_adapter_proposals(spec_assets, head_adapters):
    """The serving kernels on the head's layouts (ragged prefill, draft steps, tree frontiers;
    on the static path, the fixed graph buffers): the isolation check above, on EAGLE3's
    2H-wide q/k/v and fc. On the interpreter where no CUDA device is present, else on the GPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runners = head_runners(spec_assets, "eagle3", head_adapters["eagle3"]["attn-r8"], device=device, backend="triton")
    check_head_adapter_proposals(*runners, device, exact=False)


def test_head_adapters_are_read_against_the_head(spec_assets, head_adapters, tmp_path):
    _, eager, _ = head_runners(spec_assets, "eagle", head_adapters["eagle"]["attn-r8"])
    pool = eager.lora
    assert pool.get("x").target_modules == HEAD_LORA_MODULES
    with pytest.raises(AdapterError) as err:  # the EAGLE3 head's fc and q/k/v are wider
        pool.load("other", head_adapters["eagle3"]["attn-r8"])
    assert "fc lora_A has shape" in str(err.value) or "lora_A has shape" in str(err.value)
    with pytest.raises(AdapterError) as err:  # a target adapter names layers the head lacks
        pool.load("target", spec_assets.adapters["all-r16"])
    assert "one decoder layer" in str(err.value)
    for module in ("lm_head", "embed_tokens"):
        bad = tmp_path / module
        build_eagle_draft_adapter(bad, spec_assets.eagle, rank=4, target_modules=("q_proj",))
        raw = json.loads((bad / "adapter_config.json").read_text())
        raw["target_modules"] = ["q_proj", module]
        (bad / "adapter_config.json").write_text(json.dumps(raw))
        with pytest.raises(AdapterError) as err:
            pool.load(module, bad)
        assert f"shares the target's base {module}" in str(err.value) and err.value.field == "target_modules"
    big = build_eagle_draft_adapter(tmp_path / "big", spec_assets.eagle, rank=32)
    with pytest.raises(AdapterError) as err:
        pool.load("big", big)
    assert "draft_max_lora_rank" in str(err.value) and err.value.field == "r"
    assert [i.name for i in pool.list()] == ["x"]  # every refusal left the pool as it was


# --------------------------------------------------------------------------- the effect


@pytest.fixture(scope="module")
def layer_head(tmp_path_factory) -> dict[str, Path]:
    """A one-layer target whose attention adds nothing (o_proj 0), so its next token is a
    function of the current token; an EAGLE head that IS its layer (fc = [I, 0] passes the
    token's embedding; the head's missing final norm only rescales, argmax unchanged), so the
    shared head proposes exactly the base target's tokens; an MLP adapter that moves them."""
    from safetensors.torch import load_file, save_file

    from loraserve.runtime.dev.devmodels import build_adapter, build_tiny_model

    root = tmp_path_factory.mktemp("layer_head")
    target = build_tiny_model(root / "target", num_layers=1, seed=7, initializer_range=0.2)
    weights = load_file(str(target / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.weight"].zero_()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    adapter = build_adapter(
        root / "adapter", target, rank=8, alpha=16, target_modules=("gate_proj", "up_proj", "down_proj"), seed=8,
        init_std=0.15,
    )  # fmt: skip
    head = build_eagle_draft(root / "head", target, version=1)
    tensors = load_file(str(head / "model.safetensors"))
    for name in tensors:
        if name.startswith("layers.0."):
            tensors[name] = weights[f"model.{name}"].clone()
    hidden = tensors["fc.weight"].shape[0]
    tensors["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    save_file(tensors, str(head / "model.safetensors"), metadata={"format": "pt"})
    corpus = root / "corpus.txt"
    corpus.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8"))
    return {"target": target, "adapter": adapter, "head": head, "corpus": corpus, "root": root}


def _layer_config(models: dict[str, Path], pool: int = 1) -> RuntimeConfig:
    config = RuntimeConfig()
    config.model.path = str(models["target"])
    config.device = "cpu"
    config.scheduler.max_total_tokens = 4096
    config.scheduler.max_running_requests = 8
    config.lora.max_rank = 16
    config.lora.backend = "torch"
    config.lora.adapters = {"mlp": str(models["adapter"])}
    spec = config.speculative
    spec.algorithm = SpecAlgorithm.EAGLE
    spec.draft_model_path = str(models["head"])
    spec.num_steps, spec.num_draft_tokens = 3, 4
    spec.draft_max_loras, spec.draft_max_lora_rank = pool, 16
    return config


def _layer_requests():
    gen = torch.Generator().manual_seed(11)
    names = ["mlp", None, "mlp", "mlp"]
    return [
        (
            f"q{i}",
            torch.randint(3, 500, (6,), generator=gen).tolist(),
            SamplingParams(max_tokens=24, temperature=0.0),
            name,
        )
        for i, name in enumerate(names)
    ]


def _rate(run, adapter: str | None) -> float:
    stats = run.engine.decoder.metrics.snapshot().per_adapter[adapter or BASE_LABEL]
    return stats.accepted_tokens / stats.draft_tokens


@pytest.fixture(scope="module")
def layer_runs(layer_head, engine_run):
    """Spec off, and spec on without draft adapters: the references."""
    off = _layer_config(layer_head)
    off.speculative.algorithm = SpecAlgorithm.NONE
    plain = engine_run(off, _layer_requests())
    shared = engine_run(_layer_config(layer_head), _layer_requests())
    return {rid: plain.outputs[rid].tokens for rid, *_ in _layer_requests()}, shared


def _served(engine_run, layer_head, draft_adapter: Path):
    def hook(decoder):
        decoder.drafter.lora.load("mlp", draft_adapter)

    return engine_run(_layer_config(layer_head), _layer_requests(), decoder_hook=hook)


def _check_outputs(run, expected) -> None:
    for rid, *_ in _layer_requests():
        assert run.outputs[rid].error is None and run.outputs[rid].tokens == expected[rid], rid


def test_target_adapter_as_head_accepts(engine_run, layer_head, layer_runs):
    """The targets own adapter as head adapter accepts every draft."""
    expected, shared = layer_runs
    assert _rate(shared, None) == 1.0  # the head is the base target's layer
    assert _rate(shared, "mlp") < 0.8  # the adapter moved the target away from the shared head
    # peft names the target adapter's tensors model.layers.0.mlp.*: the head's own names.
    adapted = _served(engine_run, layer_head, layer_head["adapter"])
    _check_outputs(adapted, expected)
    assert _rate(adapted, "mlp") == 1.0
    assert _rate(adapted, None) == 1.0


@pytest.fixture
def one_thread():
    """Training the tiny head runs far faster on one thread (and leaves the other core free)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _traffic(engine_run, layer_head, count: int = 48) -> torch.Tensor:
    """The adapted target's own greedy text, ``[count, 32]`` token ids: what distillation should
    see (the adapter's prompts and answers), other prompts than the served ones."""
    config = _layer_config(layer_head)
    config.speculative.algorithm = SpecAlgorithm.NONE
    gen = torch.Generator().manual_seed(12)
    requests = [
        (f"t{i}", torch.randint(3, 500, (6,), generator=gen).tolist(), SamplingParams(max_tokens=26, temperature=0.0, ignore_eos=True), "mlp")
        for i in range(count)
    ]  # fmt: skip
    run = engine_run(config, requests)
    return torch.tensor([prompt + run.outputs[rid].tokens for rid, prompt, *_ in requests])


def test_distilled_head_adapter_lifts(
    engine_run, layer_head, layer_runs, tmp_path, monkeypatch, one_thread
):
    """The distillation of ``loraserve-distill-draft`` (its teacher, head student, loop and
    writer) on the adapter's traffic; the CLI's text path is tested beside it."""
    from loraserve.runtime.tools.distill.eagle import check_written_head_adapter, load_head_pair
    from loraserve.runtime.tools.distill.models import LoraSettings, load_teacher
    from loraserve.runtime.tools.distill.objective import score
    from loraserve.runtime.tools.distill.train import TrainSettings, train

    expected, shared = layer_runs
    traffic = _traffic(engine_run, layer_head)
    lora = LoraSettings(rank=8, alpha=16, target_modules=("gate_proj", "up_proj", "down_proj", "fc"))
    adapted = load_teacher(layer_head["target"], layer_head["adapter"], torch.float32, "cpu")
    teacher, student, width = load_head_pair(
        layer_head["target"],
        layer_head["head"],
        adapted,
        lora,
        seq_len=32,
        dtype=torch.float32,
        device="cpu",
        seed=0,
    )
    before = score(teacher, student, traffic[:8], width, batch_size=8, device="cpu")
    train(teacher, student, traffic[8:], width, TrainSettings(steps=300, batch_size=8, lr=1e-2), device="cpu")
    after = score(teacher, student, traffic[:8], width, batch_size=8, device="cpu")
    assert after.agreement > before.agreement + 0.4, (before, after)  # measured: 0.10 -> 0.77
    out = tmp_path / "head-adapter"
    student.save(out)
    check_written_head_adapter(out, layer_head["head"], lora)

    distilled = _served(engine_run, layer_head, out)
    _check_outputs(distilled, expected)
    assert _rate(distilled, "mlp") > _rate(shared, "mlp") + 0.15  # measured: 0.04 -> 0.29
    assert _rate(distilled, None) == 1.0  # base requests draft with the shared head, as before
    # Mutation: with the lease ignored every request drafts unadapted, and the lift is gone.
    monkeypatch.setattr(DraftAdapterLeases, "name_for", lambda self, req: None)
    ignored = _served(engine_run, layer_head, out)
    _check_outputs(ignored, expected)
    assert _rate(ignored, "mlp") == _rate(shared, "mlp")


@pytest.mark.parametrize("head", ["layer", "eagle3"])
def test_cli_distils_head_adapter(
    layer_head, spec_assets, head, tmp_path, capsys, one_thread
):
    """The CLI distils a head adapter the runtime loads."""
    from loraserve.runtime.tools.distill_draft import main

    if head == "layer":
        target, adapter, draft = layer_head["target"], layer_head["adapter"], layer_head["head"]
    else:
        target, adapter, draft = spec_assets.target, spec_assets.adapters["all-r16"], spec_assets.eagle3
    out = tmp_path / "out"
    args = ["--target", str(target), "--adapter", str(adapter), "--draft", str(draft), "--corpus"]
    args += [
        str(layer_head["corpus"]),
        "--out",
        str(out),
        "--rank",
        "8",
        "--steps",
        "40",
        "--batch-size",
        "4",
    ]
    args += ["--seq-len", "32", "--lr", "1e-2", "--device", "cpu", "--quiet"]
    assert main(args) == 0
    report = json.loads((out / "distill_report.json").read_text())
    assert report["after"]["kl"] < report["before"]["kl"]
    assert report["lora"]["target_modules"] == list(HEAD_LORA_MODULES)  # a head's default: fc too
    assert report["training"]["unroll"] == 2 and len(report["after"]["step_agreement"]) == 2
    printed = capsys.readouterr().out
    assert "draft LoRA r=8" in printed and "per chained draft step (--unroll 2): step 1" in printed
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == list(HEAD_LORA_MODULES)
    from safetensors.torch import load_file

    names = sorted(load_file(str(out / "adapter_model.safetensors")))
    assert "base_model.model.fc.lora_A.weight" in names
    assert "base_model.model.layers.0.self_attn.q_proj.lora_B.weight" in names
    # Refused by name: a head LoRA never adapts the lm_head it shares with the target.
    assert main([*args[:-1], "--quiet", "--overwrite", "--target-modules", "q_proj,lm_head"]) == 2
    assert "shares the target's" in capsys.readouterr().err


# --------------------------------------------------------------------------- unrolled training


def _head_path(spec_assets, head: str) -> Path:
    """The draft ``head`` names: ``eagle``, ``eagle3``, or ``eagle3-nbr`` (the EAGLE3 head with
    ``norm_before_residual``, the speculators format's option: its residual is the normed feature)."""
    if head != "eagle3-nbr":
        return Path({"eagle": spec_assets.eagle, "eagle3": spec_assets.eagle3}[head])
    dest = Path(spec_assets.eagle3).parent / "eagle3-nbr"
    if not dest.exists():
        shutil.copytree(spec_assets.eagle3, dest)
        raw = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**raw, "norm_before_residual": True}))
    return dest


def _head_student(spec_assets, head: str, unroll: int, *, seed: int = 0):
    """The tiny target with adapter ``all-r16`` as teacher and the ``head`` student over it."""
    from loraserve.runtime.tools.distill.eagle import load_head_pair
    from loraserve.runtime.tools.distill.models import LoraSettings, load_teacher

    draft = _head_path(spec_assets, head)
    adapted = load_teacher(spec_assets.target, spec_assets.adapters["all-r16"], torch.float32, "cpu")
    lora = LoraSettings(rank=8, alpha=16, target_modules=HEAD_LORA_MODULES)
    return load_head_pair(
        spec_assets.target, draft, adapted, lora, seq_len=64, dtype=torch.float32, device="cpu", seed=seed,
        unroll=unroll,
    )  # fmt: skip


def _sequences(count: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 500, (count, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("head", list(HEADS))
def test_one_unrolled_step_first_only(spec_assets, head, one_thread):
    """``unroll`` 1 is the head student of before: the same logits, the same loss and the same
    trained LoRA, bit for bit, as the plain causal-LM path of the loop."""
    from loraserve.runtime.tools.distill.objective import chain_distillation_loss, distillation_loss
    from loraserve.runtime.tools.distill.train import TrainSettings, train

    class FirstStepOnly(torch.nn.Module):
        """The student seen as a plain draft: the loop scores its forward alone."""

        def __init__(self, student):
            super().__init__()
            self.student = student

        def forward(self, input_ids, use_cache=False):
            return self.student(input_ids)

    ids = _sequences(4, 24, seed=5)
    teacher, student, width = _head_student(spec_assets, head, unroll=1)
    [logits] = student.chain_logits(ids)
    assert torch.equal(logits, student(ids).logits)
    teacher_logits = teacher(input_ids=ids).logits
    args = {"temperature": 2.0, "top_k": 50}
    assert torch.equal(
        chain_distillation_loss([logits], teacher_logits, width, **args),
        distillation_loss(logits, teacher_logits, width, **args),
    )
    settings = TrainSettings(steps=4, batch_size=2, lr=1e-2, temperature=2.0)
    teacher_b, reference, _ = _head_student(spec_assets, head, unroll=1)
    stats = train(teacher, student, ids, width, settings, device="cpu")
    reference_stats = train(teacher_b, FirstStepOnly(reference), ids, width, settings, device="cpu")
    assert (stats.first_loss, stats.last_loss) == (reference_stats.first_loss, reference_stats.last_loss)
    for name, param in student.named_parameters():
        assert torch.equal(param, dict(reference.named_parameters())[name]), name


@pytest.mark.parametrize("head", [*HEADS, "eagle3-nbr"])
def test_unrolled_steps_match_chain(spec_assets, head, tmp_path, one_thread):
    """The oracle: each chained step of the student over whole sequences (its output feature
    and logits) is what the serving runner computes for that step from the same prefix, with
    the written adapter loaded in its draft adapter pool: the target-fed forward over the
    prefix, then ``step`` calls fed the head's own output and the next token."""
    from loraserve.runtime.tools.distill.eagle import head_chain

    steps = 3
    teacher, student, _ = _head_student(spec_assets, head, unroll=steps)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():  # a LoRA that moves the head (peft's zero lora_B would not)
        for param in student.lora_B.values():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    out = student.save(tmp_path / "adapter")
    assert "adapter_model.safetensors" in out
    ids = _sequences(1, 20, seed=6)
    feats = teacher.features(ids)
    with torch.no_grad():
        hiddens = head_chain(student.head, ids[:, 1:], feats[:, :-1], steps)
        chain = student.chain_logits(ids)

    pool = RuntimeConfig().speculative
    pool.draft_max_loras, pool.draft_max_lora_rank = 1, 16
    arch, target = tiny_target(spec_assets)
    runner = eagle_runner(_head_path(spec_assets, head), arch, target, draft_lora=pool.draft_lora_pool(RuntimeConfig().lora))
    runner.lora.load("x", tmp_path / "adapter")
    tol = {"rtol": 1e-4, "atol": 1e-4}
    for p in (0, 4, 9, 15):  # the anchor: the chain runs from the target's pair at p
        rid = f"p{p}"
        hidden = runner.forward([rid], ids[0, 1 : p + 2], feats[0, : p + 1], [p + 1], lora_names=["x"])[-1:]
        logits = runner.compute_logits(hidden)
        for s in range(steps):  # step s + 1 of the chain sits at position p + s of the sequence
            if s > 0:
                token = ids[0, p + s + 1 : p + s + 2]  # the token after the previous step's
                hidden, logits = runner.step([rid], token, hidden, lora_names=["x"])
            torch.testing.assert_close(hiddens[s][0, p + s], hidden[0], **tol)
            torch.testing.assert_close(chain[s][0, p], logits[0], **tol)
            assert int(chain[s][0, p].argmax()) == int(logits[0].argmax())
        runner.kv.free(rid)


def test_unrolled_keeps_second_step(layer_head, one_thread):
    """On the adapter's traffic, a head adapter trained over 2 chained steps agrees with the
    adapted target at the chain's second step (fed its own first output, as serving does)
    about as well as at its first; one trained on the first step alone loses agreement there."""
    from loraserve.runtime.tools.distill.eagle import load_head_pair
    from loraserve.runtime.tools.distill.models import LoraSettings, load_teacher
    from loraserve.runtime.tools.distill.objective import score
    from loraserve.runtime.tools.distill.train import TrainSettings, train

    adapted = load_teacher(layer_head["target"], layer_head["adapter"], torch.float32, "cpu")
    traffic = torch.randint(3, 500, (64, 6), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():  # the adapted target's own greedy text: what the Adapter's traffic is
        for _ in range(26):
            traffic = torch.cat([traffic, adapted(input_ids=traffic).logits[:, -1:].argmax(-1)], dim=1)
    lora = LoraSettings(rank=8, alpha=16, target_modules=("gate_proj", "up_proj", "down_proj", "fc"))
    agreement = {}
    for unroll in (1, 2):
        teacher, student, width = load_head_pair(
            layer_head["target"], layer_head["head"], adapted, lora, seq_len=32, dtype=torch.float32,
            device="cpu", seed=0, unroll=unroll,
        )  # fmt: skip
        settings = TrainSettings(steps=150, batch_size=8, lr=1e-2)
        train(teacher, student, traffic[16:], width, settings, device="cpu")
        held_out = score(teacher, student, traffic[:16], width, batch_size=16, device="cpu", steps=2)
        agreement[unroll] = held_out.step_agreement
    # measured: unroll 1: 0.665 (step 1), 0.475 (step 2); unroll 2: 0.655, 0.654
    assert agreement[2][1] > agreement[1][1] + 0.1, agreement
    assert agreement[2][0] > agreement[1][0] - 0.03, agreement
