"""Draft adapters (issue 25): the accept length a shared draft loses on adapted requests, won back.

A STANDALONE draft drafts every request unadapted, so on a request whose adapter moved the
target it predicts the base target, and fewer drafts are accepted. A draft adapter, a LoRA
for the draft distilled from the adapted target, makes that adapter's requests draft with
a draft that follows their adapter. This benchmark measures both, per adapter, beside base
requests, in ``bench/speculative``'s setting (its code trains and serves the models):

1. The small target (the standard library's Python) and the STANDALONE draft distilled from
   it, exactly as ``bench/speculative`` trains them (``speculative.models.train_models``).
2. Task adapters: one LoRA per task corpus (``--adapters``: C++ headers, transformers' model
   code, sympy, type stubs; all from installed packages, so nothing is downloaded), trained
   on the small target as it is served (its bfloat16 weights) by next-token loss on that
   corpus. Reported: how far each moves the target on held-out files of its corpus (loss
   without and with it, share of top-1 tokens it changes).
3. Draft adapters: ``loraserve-distill-draft``'s :func:`distill` for each task adapter (the
   product's command, called as a user would), the draft frozen, on text like the adapter's
   traffic, as the command asks: a slice of its corpus and the adapted target's greedy
   answers to prompts from it (``answers``); its held-out KL and top-1 agreement with the
   adapted target before and after are reported.
4. Serving through the real engine: the 8B-shaped target computing the small target's
   function (``speculative.expansion``), each task adapter expanded the same function-
   preserving way (``lora_expansion``; checked: the served adapted target against the small
   adapted target), and three decoders: plain, the shared draft, and the draft with its own
   adapter pool holding the draft adapters. At each concurrency (1, 8, 32) every request
   kind (base, each adapter) runs its own workload through the three; tokens/s, accepted
   drafts a step and output identity against plain decoding per kind.
5. The targets per adapter (``verdict``): at least half of the lost accept length won back,
   a c = 1 speedup at least 10% above the shared draft's, no loss at the highest level.

``--draft eagle`` does the same with an EAGLE head instead of the STANDALONE draft: the head
trained as ``bench/speculative`` trains it (over the small target's features) and served as
it serves it (expanded to the target's shape, an EAGLE chain of k); each head draft adapter
is distilled by :func:`distill` with the head as the student over the SMALL target with its
task adapter (the head reads the adapted target's features; the served target computes the
small one's function, so the adapter is expanded as the head is: ``draft_distillation``
says why), loaded into the head's own pool, and checked as served against the distilled
head (``head_checks``).

    python bench/draft_adapters --smoke                       # CPU, tiny shapes, under a minute
    python bench/draft_adapters --smoke --draft eagle         # the same with an EAGLE head
    python bench/draft_adapters --out da.md --json da.json    # GPU, about 8 minutes on an H100
    python bench/draft_adapters --draft eagle --out da-eagle.md --json da-eagle.json

Every phase's seconds are logged as it ends and reported (``timing``), to tune the time
budgets of a one-call GPU run. Modules in the order a run uses them: ``cli``, ``corpora``,
``task_adapters``, ``answers``, ``draft_distillation``, ``lora_expansion`` and ``serving``, ``decoders``,
``head_checks`` (``--draft eagle``), ``measure``, ``verdict``, ``report``; ``benchmark.main`` ties them together.
"""
