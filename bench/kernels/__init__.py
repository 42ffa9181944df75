"""LoRA kernel timings on Llama-3-8B shapes.

Phases, in one process:
  1. environment and the copy bandwidth of this GPU (device-to-device copy, read + write);
  2. the LoRA work of one whole layer (seven modules: four apply calls, each one launch
     or a shrink/expand pair) vs the layer's base GEMMs, each replayed from a graph over
     32 layers' weights (a whole Llama-3-8B step, so neither the base nor the adapter
     weights sit in L2), for the default choice and each path forced;
  3. per-module timings, Triton vs a straightforward torch baseline (gather each
     request's adapter weights, bmm), both replayed from CUDA graphs over rotating
     inputs so nothing is served from L2;
  4. a few alternative launch configurations on key shapes (tuning record).

Correctness against float64 references is ``tests/kernels``' (every path, graph capture,
overlap, PDL); a GPU run runs it first (``bash bench/gpu/all.sh``).

Writes ``kernels.json`` and ``kernels.md`` under ``--out`` (default ``$OUT`` or
``.cache/bench/kernels``) and prints a short table last.

    python bench/kernels               # on a CUDA machine
    TRITON_INTERPRET=1 python bench/kernels --tiny   # CPU dry run of every code path

The folder runs by path (``python bench/kernels``, or ``python bench/kernels/__main__.py``),
with or without ``-P`` / ``PYTHONSAFEPATH=1``: ``python -m bench.kernels`` would need the
repository root on ``sys.path``, where ``operator/`` shadows the standard library's ``operator``.
``__main__.py`` imports the folder as the package ``bench.kernels``
(``bench/bootstrap.py``'s ``import_package``); ``bench/kernel_profile.py`` does the same.

Modules: ``shapes`` (the modules, batches and adapter weights), ``timing`` (graph replays,
bandwidth), ``variants`` (the backends a timing can force), ``layer``, ``module_bench``, ``sweep``, ``tune`` and ``gemm``
(the timed phases), ``scenarios`` (what each phase times), ``report``, ``cli``;
``benchmark.main`` runs the phases. ``checkout`` finds ``loraserve.kernels``: importing this
package does that first, so its modules can import ``loraserve.kernels`` by name.
"""

from .checkout import import_kernels

import_kernels()
