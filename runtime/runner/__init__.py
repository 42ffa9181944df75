"""The engine core: one forward of the model over a batch.

:mod:`.forward_batch` (what a forward is asked to do), :mod:`.model_runner` (weights, KV,
LoRA and attention metadata around one forward) and :mod:`.cuda_graph` (captured replays of
decode and target-verify forwards).
"""
