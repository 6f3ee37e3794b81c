"""Speculative decoding: drafters that propose tokens for the target model to verify in one forward.

`proposer.Proposer` is the one interface of the drafters, `proposers/` holds one module per method
(n-gram, suffix, draft model, EAGLE/EAGLE-3) and `proposers.make_proposer` builds the one a
`SpeculativeConfig` names. `runner.SpecDecodeRunner` is the model runner's side (drafts in, verified
tokens out, next drafts), driving whichever proposer without asking which. `draft_control` decides how
many tokens to draft at a given batch size (`DraftLength`: the `num_speculative_tokens_per_batch_size`
schedule and the compute-bound off-switch) and how many of those each request verifies
(`DraftControl`: those whose expected acceptance pays for the verification, from the request's own
history). Verification is `pagedllm.sample.rejection_sampler`.
"""
