"""Extend steps of several requests after a cached prefix: eager vs CUDA-graph replay.

The time to first token under prefix caching is one small extend per request (e.g. 100
new tokens after a cached 1,500-token system prompt), and requests that arrive in the
same step share it. For B = 1, 2, 4, 8, 16 such requests (request ``i`` under adapter
``i % adapters``, each on a prefix-cache hit of its adapter's system prompt), this times
``ModelRunner.forward`` of the one extend step (KV allocation, adapter placement and the
forward, synchronized) eagerly and replayed from a CUDA graph (:mod:`.measure`), and
checks the graph's logits against the eager ones. Weights are random, Llama-shaped
(``bench/runtime.py``'s presets); adapters are PEFT files loaded by the runner.

    python bench/extend_graphs --smoke                     # CPU, tiny model, static path
    python bench/extend_graphs --size 8b --out r.md        # GPU (about a minute on an H100)
"""
