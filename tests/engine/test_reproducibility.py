"""Seeded and greedy requests at the machine's default dtype and optimization level (and at O0 where
that dtype is bfloat16) give the same tokens alone, beside other requests (chunked prompts and decode
rows in the same steps), after a prefix-cache hit, and as child i of an n > 1 request seeded
`seed + i`. Where the default is bfloat16 and the batch-invariant kernels run (AVX512-BF16 with a C
compiler) their logprobs are bitwise the same too; in float32 elsewhere the tokens are compared, the
logprobs to a tolerance (README: Reproducibility)."""

from __future__ import annotations

import random

import pytest
from invariance import HEAD32, assert_same, bitwise_here, choices
from tiny_llm import make_tiny_llm

from pagedllm import LLM, SamplingParams

PROMPT = "Paged attention stores keys and values in fixed-size blocks. Continuous batching mixes"


@pytest.fixture(scope="module", params=[None, 0], ids=["default-level", "O0"])
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    level = request.param
    if level == 0 and not bitwise_here():
        # There O0 runs the eager module, whose products round by the step's row count (README).
        pytest.skip("O0 keeps batch invariance only where bfloat16 runs the native body (AVX512-BF16)")
    model = make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"), **HEAD32)
    # A small step budget: prompts are chunked and share steps with decode rows. At O0 (-O0, what the
    # server tests run) nothing is compiled, but the bfloat16 native body still runs every step.
    return LLM(
        model=str(model),
        max_model_len=256,
        max_num_batched_tokens=48,
        compilation_config={"cache_dir": str(tmp_path_factory.mktemp("compile-cache"))},
        **({} if level is None else {"optimization_level": level}),
    )


def _others(seed: int) -> tuple[list[str], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = ["Hello, world! " * rng.randint(1, 6) for _ in range(5)]
    params = [
        SamplingParams(temperature=rng.choice([0.0, 0.9]), max_tokens=rng.randint(4, 24)) for _ in prompts
    ]
    return prompts, params


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1234, max_tokens=24, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=3),
    ],
    ids=["seeded", "greedy"],
)
def test_alone_beside_others_and_after_a_prefix_hit(llm: LLM, params: SamplingParams) -> None:
    prompt = f"{params.temperature} {PROMPT}"  # each case its own prompt: the first run misses the cache
    first = llm.generate([prompt], params, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    alone = choices(first)
    for seed in range(2):
        others, other_params = _others(seed)
        batch = llm.generate(
            [*others[:2], prompt, *others[2:]], [*other_params[:2], params, *other_params[2:]], use_tqdm=False
        )
        assert_same(choices(batch[2:3]), alone)
    # Alone again: the prompt's full blocks come from the prefix cache, its tail is a short chunk.
    again = llm.generate([prompt], params, use_tqdm=False)
    assert again[0].num_cached_tokens >= 16
    assert_same(choices(again), alone)


def test_n_choices_equal_requests_seeded_seed_plus_i(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=24, logprobs=2)
    children = choices(llm.generate([PROMPT], params, use_tqdm=False))
    assert len({tuple(tokens) for tokens, _ in children}) == 3, "the children share a random stream"
    for i, child in enumerate(children):
        single = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=24, logprobs=2)
        assert_same([child], choices(llm.generate([PROMPT], single, use_tqdm=False)))
