"""``--profile``: one request under torch.profiler, its operator table written out."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..harness import log
from .workloads import make_workload, run_workload

if TYPE_CHECKING:
    from .measure import MeasureOptions


def profile_run(spec_config, runner, decoder, name: str, pool, opts: MeasureOptions) -> None:
    """One request under torch.profiler, on the engine's thread; writes the operator table
    sorted by host time and by device time to ``opts.profile``."""
    from torch.profiler import ProfilerActivity, profile

    assert opts.profile is not None
    opts.profile.mkdir(parents=True, exist_ok=True)
    work = make_workload(pool, 1, min(opts.gen_tokens, 64), offset=200)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    result = run_workload(spec_config, runner, decoder, work, 1, f"profile-{name}", profiler=prof)
    table = prof.key_averages()
    text = [
        f"# {name}: one request, {result.generated} tokens in {result.seconds:.3f} s; steps {result.steps}"
    ]
    for key in ("cpu_time_total", "self_cpu_time_total", "cuda_time_total"):
        if key == "cuda_time_total" and not torch.cuda.is_available():
            continue
        text += [f"\n## sorted by {key}", table.table(sort_by=key, row_limit=30)]
    (opts.profile / f"profile-{name}.txt").write_text("\n".join(text))
    log(f"profile of {name} written to {opts.profile}")
