"""Multi-LoRA offline against HF PEFT on the same weights (float32): each adapter's greedy tokens and
their log-probabilities equal PEFT's, with base-model requests and several adapters in one batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft_adapters import SPECS, check_against_peft, make_adapter, make_base, peft_model

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_base(request.param, root / "base")
    adapters = {
        name: make_adapter(base, root / name, spec, seed) for seed, (name, spec) in enumerate(SPECS.items())
    }
    return base, adapters


def _llm(base: Path, **kwargs: object) -> LLM:
    options: dict[str, object] = dict(
        dtype="float32", max_model_len=256, enforce_eager=True, optimization_level=0, enable_lora=True
    )
    options.update(kwargs)
    return LLM(model=str(base), **options)


def test_mixed_batch_matches_peft(setup: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = setup
    names = [None, *adapters]
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    # Every adapter (and the base model) on two prompts; the first prompt shared by all, so prefix-cache
    # blocks of one adapter would be hits for the others if they were not keyed by the adapter.
    shared = _prompt(40, 0)
    jobs = [(name, shared) for name in names] + [
        (name, _prompt(17 + 5 * i, i + 1)) for i, name in enumerate(names)
    ]
    llm = _llm(base, max_loras=len(adapters), max_lora_rank=16, enable_prefix_caching=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for _, p in jobs],
        GREEDY,
        use_tqdm=False,
        lora_request=[None if name is None else loras[name] for name, _ in jobs],
    )
    models = {name: peft_model(base, None if name is None else adapters[name]) for name in names}
    tokens_per_model: dict[str | None, list[int]] = {}
    for (name, prompt), out in zip(jobs, outputs):
        completion = out.outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        check_against_peft(models[name], prompt, completion.token_ids, logprobs)
        if prompt is shared:
            tokens_per_model[name] = completion.token_ids
    # The adapters really change the output (else the comparison above proves little).
    assert len({tuple(t) for t in tokens_per_model.values()}) == len(names)
