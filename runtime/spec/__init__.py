"""Speculative decoding with co-batched LoRA adapters.

The draft proposes tokens without any adapter; the target verifies them in one
target-verify forward with each request's own adapter, and acceptance keeps exactly the
tokens the target would have produced (greedy) or its exact distribution (sampling).
"""
