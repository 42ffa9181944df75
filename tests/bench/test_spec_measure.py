"""``bench/speculative``'s measurement set-up: what runs untimed before each timed run, and the
serving configuration every run shares."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.speculative import cli
from bench.speculative.serving import runtime_config
from bench.speculative.workloads import make_workload, warmup_workload


def test_above_one_request_the_warm_up_is_the_timed_workload_itself():
    """Above concurrency 1 the warm-up runs the timed requests themselves (the same prompts and
    adapters, hence the same batch and context buckets); at 1, two requests on other prompts."""
    pool = [[i, i + 1, i + 2] for i in range(200)]
    bench = make_workload(pool, 16, 24, offset=0)
    assert warmup_workload(pool, bench, 8) is bench
    single = warmup_workload(pool, make_workload(pool, 20, 24, offset=0), 1)
    assert len(single.prompts) == 2 and single.gen_tokens == 24
    assert not set(map(tuple, single.prompts)) & set(map(tuple, bench.prompts))


def test_every_run_prefills_its_prompts_whole(tmp_path: Path):
    """No prefix cache: a draft's timed run repeats the baseline's prompts, and a cache would
    give it prefill hits the baseline's first run never had."""
    s = cli.parse(["--smoke", "--draft", "dflash"])
    config = runtime_config(s, tmp_path, {})
    assert config.scheduler.prefix_cache is False
    assert config.scheduler.max_running_requests == max(s.concurrency)


def _dflash(agreement: float, rel: float, largest: float | None) -> dict:
    return {"dflash": {"check": {"proposal_agreement": agreement, "rel_logit_diff": rel,
                                 "largest_disagreeing_margin": largest}}}  # fmt: skip


def test_a_served_draft_that_is_not_the_trained_one_is_named():
    """On a GPU a bf16 near-tie may flip; run 6's served DFLASH draft (another feature than it
    trained on: flips of 1.31 logits, logits 14% off) is named, in the report's notes. On the
    CPU only exact agreement passes."""
    from bench.speculative.checks import check_notes

    run6 = _dflash(0.821, 0.1383, 1.3125)
    assert "the served DFLASH draft proposes other tokens" in check_notes(run6, smoke=False)[0]
    assert check_notes(_dflash(0.964, 0.012, 0.0625), smoke=False) == []  # a bf16 near-tie
    assert check_notes(_dflash(0.964, 0.012, 1.0), smoke=False)  # a flip no rounding makes
    assert check_notes(_dflash(1.0, 0.08, None), smoke=False)  # logits moved beyond rounding
    assert check_notes(_dflash(1.0, 0.0, None), smoke=False) == []
    assert check_notes(_dflash(0.964, 0.0, 0.0625), smoke=True)  # the CPU computes in float32: no flips
    assert check_notes(_dflash(1.0, 0.002, None), smoke=True)
    eagle = {"eagle": {"check": {"proposal_agreement": 1.0, "rel_feature_diff": 0.0087}}}
    assert check_notes(eagle, smoke=False) == [] and check_notes(eagle, smoke=True)
    assert check_notes({}, smoke=True) == []


def test_the_exit_code_fails_a_gpu_run_whose_draft_failed_its_check():
    """A served draft that is not the trained one (a check note), or a failed or skipped
    run, makes any run exit 1, GPU runs included; differing outputs fail only a smoke, since
    bf16 batching on a GPU may change an output legitimately."""
    from types import SimpleNamespace

    from bench.speculative.benchmark import verdict
    from bench.speculative.concurrency import Results
    from bench.speculative.measure import Row

    differs = Row(1, "dflash", 10.0, 20.0, 2.0, {}, same=3, count=4)
    gpu, smoke = SimpleNamespace(smoke=False), SimpleNamespace(smoke=True)
    assert verdict(gpu, Results(rows=[differs])) == 0
    assert verdict(smoke, Results(rows=[differs])) == 1
    checked = Results(rows=[replace(differs, same=4)], notes=["the served DFLASH draft proposes other tokens"])
    assert verdict(gpu, checked) == 1 and verdict(smoke, checked) == 1
    assert verdict(gpu, Results(rows=[replace(differs, same=4)])) == 0


def test_the_target_is_capped_at_a_step_count_unless_max_steps_says_otherwise():
    """On a GPU the target trains ``TARGET_STEPS`` steps at most, so a faster GPU trains the
    same target rather than one that memorised its corpus; ``--max-steps`` overrides it (0:
    no cap), and a smoke keeps its own budget."""
    from bench.speculative.settings import TARGET_STEPS

    assert cli.parse([]).max_steps == (TARGET_STEPS, None, None)
    assert cli.parse(["--max-steps", "0,0,0"]).max_steps == (None, None, None)
    assert cli.parse(["--max-steps", "500,0,900"]).max_steps == (500, None, 900)
    assert cli.parse(["--smoke"]).max_steps == (None, None, None)
