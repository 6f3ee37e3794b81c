"""SpeculativeConfig: speculative decoding (draft tokens verified by the target model)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pagedllm.config.utils import config, hash_fields

SpeculativeMethod = Literal[
    "ngram",
    "ngram_gpu",
    "draft_model",
    "eagle",
    "eagle3",
    "mtp",
    "dflash",
    "dspark",
    "medusa",
    "mlp_speculator",
    "suffix",
    "custom_class",
    "extract_hidden_states",
]

# The methods with a drafter (`pagedllm.spec_decode.proposers.PROPOSERS`); config/support.py rejects
# the others.
IMPLEMENTED_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")

# Methods whose drafter reads the target's hidden states (EAGLE family; MTP aliases normalize to "mtp").
EAGLE_FAMILY = frozenset({"eagle", "eagle3", "extract_hidden_states", "mtp", "dflash"})
NGRAM_GPU_METHODS = frozenset({"ngram_gpu"})
# use_eagle(): drafters that need the target's hidden states and a prefill lookahead.
_USE_EAGLE = frozenset({"eagle", "eagle3", "mtp", "dflash"})


@config
class SpeculativeConfig:
    """Configuration of speculative decoding."""

    method: SpeculativeMethod = "ngram"
    """Drafting method."""
    num_speculative_tokens: Annotated[int, Field(ge=1)] | None = None
    """Tokens drafted per step (K)."""
    model: str | None = None
    """Draft model (draft_model, EAGLE, MTP heads)."""
    num_speculative_tokens_per_batch_size: dict[int, int] | None = None
    """Dynamic speculative decoding: {largest batch size: draft length}, e.g. {4: 3, 8: 1} drafts 3
    tokens for batches up to 4 requests and 1 up to 8."""
    draft_model_config: Any = None
    """Resolved model config of the draft model (set by the engine)."""
    target_model_config: Any = None
    """Model config of the target model (set by the engine)."""
    disable_padded_drafter_batch: bool = False
    """Run the drafter on the unpadded batch (incompatible with async scheduling)."""
    parallel_drafting: bool = False
    """Draft all K tokens in one drafter pass (P-EAGLE, DFlash, DSpark)."""
    mtp_num_modules: Annotated[int, Field(ge=1)] = 1
    """Number of MTP modules of the target model (more than one: one module per draft position)."""
    draft_sample_method: Literal["probabilistic", "greedy"] = "probabilistic"
    """How draft tokens are sampled."""
    rejection_sample_method: Literal["standard", "strict"] = "standard"
    """How draft tokens are accepted."""
    enable_adaptive_verification: bool = False
    """Verify fewer draft tokens when acceptance is low."""
    use_heterogeneous_vocab: bool = False
    """Draft model with a vocabulary different from the target's."""
    prompt_lookup_max: Annotated[int, Field(ge=1)] | None = None
    """n-gram: longest n-gram matched in the prompt."""
    prompt_lookup_min: Annotated[int, Field(ge=1)] | None = None
    """n-gram: shortest n-gram matched in the prompt."""
    suffix_decoding_max_tree_depth: Annotated[int, Field(ge=1)] = 24
    """suffix: longest token sequence kept in the suffix tries (prefix match + drafted tokens)."""
    suffix_decoding_max_cached_requests: Annotated[int, Field(ge=0)] = 10000
    """suffix: finished requests whose outputs the global trie keeps (0 disables it)."""
    suffix_decoding_max_spec_factor: Annotated[float, Field(ge=0)] = 1.0
    """suffix: at most this many drafts per token of the matched prefix."""
    suffix_decoding_min_token_prob: Annotated[float, Field(ge=0, le=1)] = 0.1
    """suffix: stop drafting where the estimated probability of the drafted run falls below this."""

    def __post_init__(self) -> None:
        if self.method == "suffix" and self.num_speculative_tokens is None:
            # As vLLM: the tree depth bounds what suffix decoding can draft anyway.
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens must be set")
        if self.method in ("ngram", "ngram_gpu"):
            # vLLM's defaults: 5 when neither is set, else the one that is set for both.
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min = self.prompt_lookup_max = 5
            elif self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            elif self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min
            if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
                raise ValueError(
                    f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must be <= "
                    f"prompt_lookup_max={self.prompt_lookup_max}"
                )
        if self.num_speculative_tokens_per_batch_size is not None:
            # Validated now so a bad schedule fails at construction, not at graph sizing.
            self.dense_draft_lengths(max(self.num_speculative_tokens_per_batch_size))

    def use_eagle(self) -> bool:
        return self.method in _USE_EAGLE

    def use_dflash(self) -> bool:
        return self.method == "dflash"

    def use_dspark(self) -> bool:
        return self.method == "dspark"

    def use_multi_module_mtp(self) -> bool:
        return self.method == "mtp" and self.mtp_num_modules > 1

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def uses_dynamic_speculative_decoding(self) -> bool:
        return self.num_speculative_tokens_per_batch_size is not None

    @property
    def max_num_new_slots_for_drafting(self) -> int:
        """Extra KV slots per request drafting needs beyond the verified tokens."""
        assert self.num_speculative_tokens is not None
        slots = self.num_speculative_tokens - 1 if self.parallel_drafting else 0
        return slots + (1 if self.method == "draft_model" else 0)

    def dense_draft_lengths(self, max_batch: int) -> list[int]:
        """Draft length for every batch size 0..max_batch (index = batch size; index 0 unused).

        Raises ValueError when the schedule is empty, names a length above num_speculative_tokens, or
        does not cover `max_batch`."""
        schedule = self.num_speculative_tokens_per_batch_size
        assert schedule is not None and self.num_speculative_tokens is not None
        if not schedule:
            raise ValueError("num_speculative_tokens_per_batch_size is empty")
        bounds = sorted(schedule)
        for bound in bounds:
            length = schedule[bound]
            if bound < 1 or not 0 <= length <= self.num_speculative_tokens:
                raise ValueError(
                    f"num_speculative_tokens_per_batch_size entry {bound}: {length} is invalid (batch sizes "
                    f">= 1, lengths 0..num_speculative_tokens={self.num_speculative_tokens})"
                )
        if bounds[-1] < max_batch:
            raise ValueError(
                f"num_speculative_tokens_per_batch_size covers batch sizes up to {bounds[-1]}, not {max_batch}"
            )
        lengths = [self.num_speculative_tokens]
        idx = 0
        for bs in range(1, max_batch + 1):
            while bounds[idx] < bs:
                idx += 1
            lengths.append(schedule[bounds[idx]])
        return lengths

    def compute_hash(self) -> str:
        return hash_fields(self, ("method", "num_speculative_tokens", "model", "parallel_drafting"))
