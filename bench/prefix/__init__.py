"""Prefix caching per adapter: TTFT and throughput with the cache on and off.

Workloads of realistic shape (:mod:`.workloads`): 8 adapters, each with its own
1,500-token system prompt, and 64 concurrent users sending 100-token questions (who think
between an answer and their next question, or send it at once: `--think-s`); a
multi-turn chat replay (every turn resends the whole conversation); and prompts that
share nothing, for the cache's cost. Each runs through the real engine (continuous
batching, chunked prefill, adapters) twice, cache off then on (:mod:`.driver`), and the
report (:mod:`.report`) gives TTFT p50/p99, output tok/s, the hit rate and whether the
two runs produced the same tokens.

    python bench/prefix --smoke                 # CPU, tiny model, seconds
    python bench/prefix --size 8b --out r.md    # GPU, random Llama-8B-shaped weights
"""
