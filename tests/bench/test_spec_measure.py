"""``bench/speculative``'s measurement set-up: what runs untimed before each timed run, and the
serving configuration every run shares."""

from __future__ import annotations

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
