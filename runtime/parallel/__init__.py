"""Tensor parallelism inside one pod: process groups, sharding, the launcher, collectives.

Nothing here is imported by a single-device runtime's hot path; see ``launch`` for the
entry point the CLI calls and ``sharding`` for how the model and adapters are cut.
"""
