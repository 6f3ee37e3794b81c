"""Sampling building blocks: batched metadata, logit transforms and logprobs (used by layers/sampler.py)."""

from pagedllm.sample.logprobs import LogprobsTensors, compute_prompt_logprobs
from pagedllm.sample.metadata import SamplingMetadata, build_sampling_metadata, make_generator

__all__ = [
    "LogprobsTensors",
    "SamplingMetadata",
    "build_sampling_metadata",
    "compute_prompt_logprobs",
    "make_generator",
]
