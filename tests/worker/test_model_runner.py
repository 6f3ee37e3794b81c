"""ModelRunner against HF transformers on tiny random models (float32, greedy and logprobs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from runner_driver import RunnerDriver, hf_greedy, make_config, save_tiny_model

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner

PROMPTS = {
    "a": list(range(5, 25)),  # 20 tokens: crosses a block boundary while decoding
    "b": [100, 101, 102],
    "c": [7 * i % 256 for i in range(1, 41)],  # 40 tokens: 3 blocks
}
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf_tokens(model_dir: Path) -> dict[str, list[int]]:
    return {k: hf_greedy(model_dir, p, MAX_TOKENS) for k, p in PROMPTS.items()}


def make_runner(model_dir: Path, num_blocks: int = 64, optimization_level: int = 0, **kw) -> ModelRunner:
    # Eager (O0) unless asked: these tests are about the runner's batching, state and sampling; at the
    # default O2 every runner here cost a Dynamo trace and Inductor compiles (~6 min of the suite).
    runner = ModelRunner(make_config(model_dir, optimization_level=optimization_level, **kw))
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


def test_mixed_batch_greedy_matches_hf(model_dir: Path, hf_tokens: dict[str, list[int]]) -> None:
    # Requests join while others decode: steps mix whole prefills with decodes. Qwen2 (biased q/k/v)
    # runs the default compiled (O2) forward here; Llama's compiled forward has test_compiled_forward.py.
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    level = 2 if model_type == "qwen2" else 0
    driver = RunnerDriver(make_runner(model_dir, optimization_level=level), num_blocks=64)
    driver.add("a", PROMPTS["a"], MAX_TOKENS)
    driver.step()
    driver.add("b", PROMPTS["b"], MAX_TOKENS)
    driver.step()
    driver.step()
    driver.add("c", PROMPTS["c"], MAX_TOKENS)
    assert driver.run() == hf_tokens


@pytest.mark.parametrize("chunk_size", [1, 7, 16])
def test_chunked_prefill_matches_hf(
    model_dir: Path, hf_tokens: dict[str, list[int]], chunk_size: int
) -> None:
    driver = RunnerDriver(make_runner(model_dir), num_blocks=64, chunk_size=chunk_size)
    for k, p in PROMPTS.items():
        driver.add(k, p, MAX_TOKENS)
    assert driver.run() == hf_tokens
    # A chunk that leaves part of the prompt uncomputed samples nothing.
    for k, r in driver.reqs.items():
        num_chunks = -(-len(PROMPTS[k]) // chunk_size)
        assert all(h == [] for h in r.history[: num_chunks - 1])
        assert all(len(h) == 1 for h in r.history[num_chunks - 1 :])


def test_preempted_request_resumes_with_same_output(model_dir: Path, hf_tokens: dict[str, list[int]]) -> None:
    driver = RunnerDriver(make_runner(model_dir), num_blocks=64, chunk_size=16)
    for k, p in PROMPTS.items():
        driver.add(k, p, MAX_TOKENS)
    for _ in range(6):
        driver.step()
    driver.preempt("c")  # resent later as a new request with prompt + outputs so far
    driver.step()
    driver.preempt("a")
    assert driver.run() == hf_tokens


def test_finished_rows_are_reused(model_dir: Path, hf_tokens: dict[str, list[int]]) -> None:
    # More requests over time than the batch has rows (max_num_seqs=2).
    runner = make_runner(model_dir, max_num_seqs=2)
    for round_ in range(3):
        driver = RunnerDriver(runner, num_blocks=64, seed=round_)
        driver.add(f"a{round_}", PROMPTS["a"], MAX_TOKENS)
        driver.add(f"b{round_}", PROMPTS["b"], MAX_TOKENS)
        out = driver.run()
        driver.step()  # delivers the finished ids
        assert out == {f"a{round_}": hf_tokens["a"], f"b{round_}": hf_tokens["b"]}
    assert runner.input_batch.num_reqs == 0


def test_seeded_sampling_independent_of_batch(model_dir: Path) -> None:
    def run(with_others: bool) -> list[int]:
        driver = RunnerDriver(make_runner(model_dir), num_blocks=64, chunk_size=16)
        if with_others:
            driver.add("x", PROMPTS["c"], 8, SamplingParams(temperature=1.0, max_tokens=8))
            driver.add("g", PROMPTS["b"], 8)
        driver.add("s", PROMPTS["a"], 8, SamplingParams(temperature=1.0, seed=1234, max_tokens=8))
        if with_others:
            driver.add("y", PROMPTS["b"], 8, SamplingParams(temperature=0.7, seed=5, max_tokens=8))
        return driver.run()["s"]

    alone = run(False)
    assert run(True) == alone
    # The seed matters (the test could fail): another seed gives another sequence.
    driver = RunnerDriver(make_runner(model_dir), num_blocks=64)
    driver.add("s", PROMPTS["a"], 8, SamplingParams(temperature=1.0, seed=4321, max_tokens=8))
    assert driver.run()["s"] != alone


def test_seeded_request_survives_preemption(model_dir: Path) -> None:
    def run(preempt: bool) -> list[int]:
        driver = RunnerDriver(make_runner(model_dir), num_blocks=64)
        driver.add("s", PROMPTS["a"], 10, SamplingParams(temperature=1.0, seed=99, max_tokens=10))
        for _ in range(4):
            driver.step()
        if preempt:
            driver.preempt("s")
        return driver.run()["s"]

    assert run(True) == run(False)


def _hf_logprobs(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return logits.log_softmax(-1)


def test_prompt_and_sample_logprobs_match_hf(model_dir: Path, hf_tokens: dict[str, list[int]]) -> None:
    prompt = PROMPTS["c"]
    driver = RunnerDriver(make_runner(model_dir), num_blocks=64, chunk_size=7)
    driver.add("c", prompt, 4, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2))
    prompt_lps = []
    sample_lps = []
    for _ in range(20):
        if len(driver.reqs["c"].outputs) >= 4:
            break
        out = driver.step()
        if "c" in out.prompt_logprobs:
            prompt_lps.append(out.prompt_logprobs["c"])
        lp = out.logprobs[out.req_id_to_index["c"]]
        if lp is not None:
            sample_lps.append(lp)
    outputs = driver.reqs["c"].outputs
    assert outputs == hf_tokens["c"][:4]
    ref = _hf_logprobs(model_dir, prompt + outputs)

    ids = [row for part in prompt_lps for row in part.token_ids]
    lps = [row for part in prompt_lps for row in part.logprobs]
    assert len(ids) == len(prompt) - 1  # one per prompt token after the first, across 6 chunks
    for pos, (row_ids, row_lps) in enumerate(zip(ids, lps)):
        assert row_ids[0] == prompt[pos + 1]
        want_lp = ref[pos]
        np.testing.assert_allclose(row_lps[0], want_lp[prompt[pos + 1]].item(), atol=1e-4)
        assert row_ids[1:] == want_lp.topk(2).indices.tolist()
        np.testing.assert_allclose(row_lps[1:], want_lp.topk(2).values.tolist(), atol=1e-4)

    assert len(sample_lps) == 4
    for step, lp in enumerate(sample_lps):
        pos = len(prompt) - 1 + step
        assert lp.token_ids[0][0] == outputs[step] and lp.sampled_token_ranks == [1]
        assert lp.token_ids[0][1:] == ref[pos].topk(3).indices.tolist()
        np.testing.assert_allclose(lp.logprobs[0][1:], ref[pos].topk(3).values.tolist(), atol=1e-4)


def test_empty_step_only_updates_state(model_dir: Path) -> None:
    runner = make_runner(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    so = SchedulerOutput(
        [NewRequestData("r", [1, 2, 3], 3, params, [5], 0)], CachedRequestData(), {"r": 3}, 3
    )
    runner.execute_model(so)
    assert runner.sample_tokens(None).sampled_token_ids[0] != []
    runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"r"}))
    out = runner.sample_tokens(None)
    assert out.req_ids == [] and runner.input_batch.num_reqs == 0


def test_kv_cache_layout_and_budget(model_dir: Path) -> None:
    runner = ModelRunner(make_config(model_dir, kv_cache_memory_bytes=3 * 2**20))
    runner.load_model()
    spec = runner.get_kv_cache_spec()
    # 2 layers x (K and V) x 16 tokens x 2 KV heads x head_size 16 x 4 bytes.
    assert spec.num_layers == 2 and spec.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert runner.determine_available_kv_cache_bytes() == 3 * 2**20
    runner.initialize_kv_cache(10)
    # The attention backend's layout (torch backend: [2, num_blocks, kv_heads, block_size, head]).
    assert [tuple(c.shape) for c in runner.kv_caches] == [(2, 10, 2, 16, 16)] * 2
    assert all(c.dtype == torch.float32 and not c.any() for c in runner.kv_caches)


def test_default_cpu_budget_is_capped_by_full_occupancy(model_dir: Path) -> None:
    runner = ModelRunner(make_config(model_dir, max_num_seqs=4))
    runner.load_model()
    full = 4 * (128 // 16) * runner.get_kv_cache_spec().bytes_per_block
    assert 0 < runner.determine_available_kv_cache_bytes() <= full


def test_repetition_penalty_reads_prompt_and_output(model_dir: Path, hf_tokens: dict[str, list[int]]) -> None:
    # The sampler's penalties see the runner's prompt and generated tokens (HF applies the same rule).
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS["b"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, repetition_penalty=3.0)
    driver = RunnerDriver(make_runner(model_dir), num_blocks=64)
    driver.add("p", prompt, 10, SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=3.0))
    driver.add("g", PROMPTS["a"], 10)
    assert driver.run()["p"] == want[0, len(prompt) :].tolist()
    assert want[0, len(prompt) :].tolist() != hf_tokens["b"][:10]  # the penalty changed something


def test_cpu_kv_cache_commits_memory_only_when_used(model_dir: Path) -> None:
    import psutil

    runner = ModelRunner(make_config(model_dir))
    runner.load_model()
    num_blocks = 2**30 // runner.get_kv_cache_spec().bytes_per_block  # a 1 GiB cache
    rss = psutil.Process().memory_info().rss
    runner.initialize_kv_cache(num_blocks)
    assert psutil.Process().memory_info().rss - rss < 64 * 2**20
    # Still a working, zeroed cache: the last block is usable and reads back zeros elsewhere.
    cache = runner.kv_caches[0]
    cache[:, -1] = 1.0
    assert cache[:, -1].all() and not cache[:, 0].any()


@pytest.mark.parametrize(("scheduled", "budget"), [(None, 64), (40, 40), (100, 64)])
def test_the_runner_holds_the_schedulers_step_budget(model_dir: Path, scheduled: int | None, budget: int) -> None:
    # One formula (SchedulerConfig.step_token_budget) for the scheduler's budget and the runner's buffers.
    config = make_config(model_dir, optimization_level=0)
    config.scheduler_config.max_num_scheduled_tokens = scheduled
    assert ModelRunner(config).max_num_tokens == budget
