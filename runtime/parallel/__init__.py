"""Tensor parallelism inside one pod: a target model larger than one GPU.

One process per GPU. Rank 0 is the runtime itself (HTTP, scheduler, drafts, sampling);
ranks 1..N-1 are worker processes (``worker``) that the launcher (``launch``) starts.
Each rank holds its shard of the target (``sharding``: column-parallel q/k/v and
gate/up, row-parallel o/down, vocab-parallel embedding and lm_head; adapters cut the
same way) and its KV heads. Rank 0's runner describes every forward to the others
(``driver``, ``protocol``) and they replay it (``follower``), so every rank runs the
same batches and the same collectives (``group``).

The draft of speculative decoding is never sharded and runs on rank 0 only: it is small,
it sees no adapter, and its proposals reach the other ranks inside the target-verify
step description they must receive anyway (a few hundred bytes more on a message sent
regardless; ``bench/tp.py`` measures it against the draft's own cost). Running it on
every rank would buy no time (the verify waits for all ranks either way) and would cost
each GPU the draft's weights and KV cache, and each rank a copy of every request's
state.

A rank that dies, stalls past a timeout or diverges fails the whole group (``health``):
rank 0 reports it and exits with ``EXIT_TP_FAILURE``, workers exit too; the pod restarts.
"""
