"""Speculative decoding throughput: tokens/s with and without a draft, 4 adapters in the mix.

Method (everything is built inside the run; nothing is downloaded):

1. Corpus: the Python standard library's own sources, tokenized with the project's local
   byte-level BPE (``devmodels.write_tokenizer``). A few modules are held out for prompts.
2. Train a small Llama target on that corpus for a fixed number of seconds (AdamW, bf16
   autocast), then distill a much smaller Llama draft from it: KL to the target's
   next-token distribution, half of every batch being the target's own greedy
   continuations of training-corpus prompts, half corpus windows. Every draft trains on
   windows as long as a served request reads (``distillation.serving_window``: prompt, new
   tokens and a verify, rounded up to 64; ``--distill-seq`` to choose): a draft accepts
   less past the context lengths it trained on.
   ``--distill-prompts unseen`` takes the teacher prompts from code neither model trains
   on (the installed torch package's modules) at the benchmark's prompt length instead;
   on the CPU it did not beat the default, while more distillation time did.
3. Serve a Llama-3-8B-shaped target (32 layers, hidden 4096, GQA 32/8, MLP 14336; the
   vocabulary is the local tokenizer's) that computes exactly what the small trained
   target computes: its weights are a function-preserving expansion of the small model
   (extra hidden dimensions, heads, MLP units and layers contribute nothing; RMSNorm
   weights and eps rescaled so the statistics over the padded width match). The serving
   cost is that of the full 8B shape (every GEMM runs at full size); the predictions are
   those of the trained model. ``--target-shape trained`` serves the small model as is.
4. Four random PEFT adapters (all linear modules, rank 16, small B) are loaded; request
   ``i`` of a workload uses base, or adapter ``i % 5``.
   ``--draft eagle`` trains an EAGLE head instead (``--draft standalone,eagle``: both): one
   Llama decoder layer of the small target's shape over the target's own final normed
   hidden state, sharing its embeddings and LM head (the runtime's EAGLE format and
   equations, ``loraserve.runtime.speculative.eagle.format``). The input at position ``i`` is
   ``fc([embed(x[i+1]), feature[i]])``; the loss is KL to the target's distribution of
   ``x[i+2]`` plus a smooth-L1 pull towards ``feature[i+1]``, on the same batches as the
   STANDALONE distillation, for ``--train-draft-s``. Training unrolls a second draft step
   on the head's own predicted feature (as serving's steps 2..k run; ``--eagle-unroll S``
   trains steps 2..S that way, EAGLE-3's training-time test); ``--eagle-unroll 1``
   trains teacher-forced only. The target's features of the training windows are computed
   once before training (``--eagle-cache-gib``; 0: every step, as up to run 12), so the
   training budget goes to the head. For the 8B-shaped target the head is expanded the same
   function-preserving way, and a check compares the served head's proposals and output
   features with the trained head's on held-out prompts.
   ``--draft dflash`` trains a DFLASH draft (``loraserve.runtime.speculative.dflash.format``):
   ``--dflash-layers`` layers (default 5, the reference's depth for 8B targets) of the small target's shape over as many of its
   layer outputs (spread over 1..L-3 as the reference spreads them; ``--dflash-target-layers
   top`` over 1..L-2, the deepest output a forward captures), drafting a block of
   ``--dflash-block`` tokens (default 8) in one forward. Masked block prediction on the same
   batches: random anchors per window, the block ``[x_a, mask...]`` learns the target's
   greedy token at every masked position from the target's outputs before the anchor
   (earlier positions weighted more), for ``--dflash-train-s`` (default ``--train-draft-s``;
   ``--dflash-probe-steps`` walks the held-out continuations as it trains); expanded the same
   function-preserving way, checked against the trained draft on held-out prompts, and
   served with ``num_draft_tokens`` = the block (its recipe: the ``--dflash-*`` flags).
5. For concurrency 1, 8 and 32, the same greedy workload runs through the real engine
   without speculation and with each draft's speculation (EAGLE first, so that under
   ``--deadline-s`` a second draft's run is the one skipped). Tokens/s is
   generated tokens over wall time (prefill included); accept lengths come from the
   decoder's metrics, overall and per adapter. Outputs of the two runs are compared.
   The engine's step counters say where each run's time went (extend and decode steps,
   batch occupancy, host work, CUDA graphs captured during the timed run). Concurrency 1
   runs ``--c1-requests`` requests (default 10) one after another. ``--phases DIR`` then
   times one more request per draft, and the same request without speculation, call by
   call inside each decode step (host time and CUDA-event spans; ``phases``).

    python bench/speculative --smoke                # CPU, tiny models, a minute
    python bench/speculative --out results.md       # GPU
    python bench/speculative --out results.md --draft standalone,eagle --deadline-s 480
    python bench/speculative --out results.md --draft eagle --concurrency 1 --phases phases/

The folder runs by path (``python bench/speculative``, or ``python bench/speculative/__main__.py``),
with or without ``-P`` / ``PYTHONSAFEPATH=1``: ``python -m bench.speculative`` would need the
repository root on ``sys.path``, where ``operator/`` shadows the standard library's ``operator``.
``__main__.py`` imports the folder as the package ``bench.speculative`` (see
:func:`bench.speculative.__main__.import_package`); tests import it the same way.

Modules, in the order a run uses them: ``cli`` and ``settings`` (the command line),
``corpus``, ``training``, ``distillation``, ``eagle_head`` and ``eagle_training``,
``dflash_recipe``, ``dflash_draft`` and ``dflash_training`` (what is trained; ``models`` runs
them), ``expansion``, ``eagle_checkpoint``, ``dflash_checkpoint``, ``adapters`` and
``serving`` (the 8B-shaped target and what it serves), ``checks`` and ``dflash_check``, ``decoders``,
``workloads``, ``measure``, ``identity`` and ``concurrency`` (the timed runs), ``profiling``
and ``phases`` (where a step's time goes), ``report``; ``benchmark.main`` ties them together.
"""
