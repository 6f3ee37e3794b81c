"""The cost of verifying drafts: single-stream greedy decode with n-gram drafting on the built-in
`grounded` and `chat` prompts, each engine step timed and grouped by how many drafts it verified.
Steps that verified none (no match, or the request backed off) are plain one-row decode steps of the
same process, so the ratio needs no second run. Prints, per number of drafts n, the steps, the median
step time and its excess over the plain step as a fraction of it: what `VerifyCost` in
`pagedllm/spec_decode/backoff.py` measures as the engine runs (`VERIFY_OVERHEAD` until it has).

Run: `PYTHONPATH=$PWD python benchmarks/verify_overhead.py [--num-prompts 4] [--output-len 64]
[engine args, e.g. --enforce-eager]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict

import numpy as np

from pagedllm.benchmarks.datasets import grounded_requests, open_chat_requests, render_chat
from pagedllm.config.args import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def step_times(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict[int, list[float]]:
    """Decode step times of each prompt run alone, by the number of drafts the step verified."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    by_drafts: dict[int, list[float]] = defaultdict(list)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": ids}, params)
        engine.step()  # the prefill
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            stats = engine.scheduler_stats
            by_drafts[0 if stats is None else stats.spec_num_draft_tokens].append(elapsed)
    return by_drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args()
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.speculative_config is None:
        engine_args = dataclasses.replace(engine_args, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    engine = LLMEngine.from_engine_args(engine_args)
    tokenizer = engine.get_tokenizer()
    requests = grounded_requests(args.num_prompts, args.output_len) + open_chat_requests(args.num_prompts, args.output_len)
    prompts = [r.prompt_token_ids for r in render_chat(requests, tokenizer)]
    step_times(engine, prompts[:1], args.output_len)  # warm-up: compiles the verification shapes
    by_drafts = step_times(engine, prompts, args.output_len)  # type: ignore[arg-type]
    plain = float(np.median(by_drafts[0]))
    print(f"{'drafts':>6} {'steps':>6} {'median ms':>10} {'overhead':>9}")
    for n in sorted(by_drafts):
        median = float(np.median(by_drafts[n]))
        print(f"{n:>6} {len(by_drafts[n]):>6} {1e3 * median:>10.2f} {median / plain - 1:>9.2f}")
    engine.shutdown()


if __name__ == "__main__":
    main()
