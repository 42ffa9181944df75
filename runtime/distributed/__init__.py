"""The tensor-parallel base: how a target model larger than one GPU is cut and talked over.

One process per GPU, one group per pod (``group``: the collectives every rank runs).
Each rank holds its shard of the target (``sharding``: column-parallel q/k/v and
gate/up, row-parallel o/down, vocab-parallel embedding and lm_head; adapters cut the
same way) and its KV heads. Rank 0 describes every forward to the other ranks in
messages (``protocol``). A rank that dies, stalls past a timeout or diverges fails the
whole group (``health``, ``errors``). ``context`` is the group this process belongs to.

This package sits low: model/, lora/ and the runner import it; it imports only the
contract. What drives a group (rank 0's driver, the followers, the launcher, the worker
processes) is ``loraserve.runtime.executor``, above the runner.
"""
