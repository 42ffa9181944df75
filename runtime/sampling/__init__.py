"""Token sampling: per-request parameters and a batched sampler.

``SamplingParams`` is what a request asks for (validated, with field names matching the
OpenAI API); ``Sampler`` turns a batch of logits into one token per row, vectorised over
the batch, with per-request seeds that make a request's tokens reproducible whatever else
shares its batch.
"""

from .params import SamplingParams, SamplingParamsError
from .sampler import SampleOutput, Sampler, make_generator, processed_probs

__all__ = [
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "SamplingParamsError",
    "make_generator",
    "processed_probs",
]
