"""Tensor parallelism inside one pod: the processes that run a sharded target together.

Rank 0 is the runtime itself (HTTP, scheduler, drafts, sampling); ranks 1..N-1 are
worker processes (``worker``) that the launcher (``launch``) starts. Rank 0's runner
describes every forward to the others (``driver``) and they replay it (``follower``),
so every rank runs the same batches and the same collectives. The base these build on
(sharding, group, protocol, health) is ``loraserve.runtime.distributed``.

The draft of speculative decoding is never sharded and runs on rank 0 only: it is small,
it sees no adapter, and its proposals reach the other ranks inside the target-verify
step description they must receive anyway (a few hundred bytes more on a message sent
regardless; ``bench/tp.py`` measures it against the draft's own cost). Running it on
every rank would buy no time (the verify waits for all ranks either way) and would cost
each GPU the draft's weights and KV cache, and each rank a copy of every request's
state.

A rank that dies, stalls past a timeout or diverges fails the whole group: rank 0
reports it and exits with ``EXIT_TP_FAILURE``, workers exit too; the pod restarts.
"""
