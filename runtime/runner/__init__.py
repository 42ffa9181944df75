"""The engine core: one forward of the model over a batch.

:mod:`.forward_batch` (what a forward is asked to do), :mod:`.model_runner` (weights, KV,
LoRA and attention metadata around one forward), :mod:`.graph_runner` (capture and replay of
CUDA graphs per batch-size bucket, shared by the target and the EAGLE head) and
:mod:`.cuda_graph` (the target's captured decode and target-verify forwards).
"""
