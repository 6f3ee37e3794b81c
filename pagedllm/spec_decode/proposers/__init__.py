"""The drafters, one module per method, each a `pagedllm.spec_decode.proposer.Proposer`; `make_proposer`
builds the one a `SpeculativeConfig` names (the only place that reads the method's name)."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.config import EngineConfig
from pagedllm.spec_decode.proposer import DrafterLoaders, Proposer
from pagedllm.spec_decode.proposers.draft_model import DraftModelProposer
from pagedllm.spec_decode.proposers.eagle import EagleProposer
from pagedllm.spec_decode.proposers.ngram import NgramProposer
from pagedllm.spec_decode.proposers.suffix import SuffixProposer


def _ngram(engine_config: EngineConfig, loaders: DrafterLoaders) -> Proposer:
    spec = engine_config.speculative_config
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


def _suffix(engine_config: EngineConfig, loaders: DrafterLoaders) -> Proposer:
    spec = engine_config.speculative_config
    return SuffixProposer(
        spec.suffix_decoding_max_tree_depth,
        spec.suffix_decoding_max_cached_requests,
        spec.suffix_decoding_max_spec_factor,
        spec.suffix_decoding_min_token_prob,
    )


def _draft_model(engine_config: EngineConfig, loaders: DrafterLoaders) -> Proposer:
    return DraftModelProposer(engine_config, loaders.draft_model)


def _eagle(engine_config: EngineConfig, loaders: DrafterLoaders) -> Proposer:
    return EagleProposer(engine_config, loaders.eagle_head)


PROPOSERS: dict[str, Callable[[EngineConfig, DrafterLoaders], Proposer]] = {
    "ngram": _ngram,
    "suffix": _suffix,
    "draft_model": _draft_model,
    "eagle": _eagle,
    "eagle3": _eagle,
}


def make_proposer(engine_config: EngineConfig, loaders: DrafterLoaders) -> Proposer:
    method = engine_config.speculative_config.method
    build = PROPOSERS.get(method)
    if build is None:
        raise ValueError(f"speculative_config.method={method!r} has no drafter ({', '.join(PROPOSERS)})")
    return build(engine_config, loaders)
