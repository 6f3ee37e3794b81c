"""The native decode path: every decode step's greedy pick and logprob against transformers on the
same tokens (as the compiled graphs it replaces), with odd matrix shapes, a sliding window, biases on
every projection and per-head q/k norms; models it cannot run keep the graphs. A bfloat16 model the
prompt kernel serves runs every step natively, and a token's logprob is bitwise the same computed in
a whole prompt, in prompt chunks, as a decode row alone and beside other requests."""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worker"))
from kernel_builds import forced_flag_set  # noqa: E402
from runner_driver import RunnerDriver, make_config  # noqa: E402
from served_steps import count_served  # noqa: E402

from pagedllm.config import CompilationConfig, EngineConfig  # noqa: E402
from pagedllm.config.model import ModelConfig  # noqa: E402
from pagedllm.kernels.abi import LlamaModel  # noqa: E402
from pagedllm.layers import bf16_gemm  # noqa: E402
from pagedllm.layers.linear import LinearBase  # noqa: E402
from pagedllm.layers.quant import LinearMethodBase  # noqa: E402
from pagedllm.models import load_model  # noqa: E402
from pagedllm.models.interfaces import HasDecoderLayers, SupportsEagle3, SupportsNativeDecode  # noqa: E402
from pagedllm.models.native import llama_decode  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.worker.compiled_forward import CompiledForward  # noqa: E402
from pagedllm.worker.model_runner import ModelRunner  # noqa: E402

needs_native = pytest.mark.skipif(
    not llama_decode.supports_dtype(torch.bfloat16),
    reason="the native decode path of bfloat16 weights needs a C compiler and AVX512-BF16",
)
needs_every_step = pytest.mark.skipif(
    not llama_decode.supports_dtype(torch.bfloat16) or not bf16_gemm.available(),
    reason="the native body of every step needs a C compiler and AVX512-BF16",
)
needs_native_f32 = pytest.mark.skipif(
    not llama_decode.supports_dtype(torch.float32),
    reason="the native decode path of float32 weights needs a C compiler and AVX-512 or AVX2 + FMA",
)

_BASE: dict[str, Any] = dict(
    num_hidden_layers=2,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.15,  # peaked logits: no near-ties for bfloat16 rounding to flip
    eos_token_id=None,
    pad_token_id=0,
)
# Widths that are not multiples of the kernels' 16 rows and 32 columns: the tails of every loop.
_ODD: dict[str, Any] = dict(
    hidden_size=80, intermediate_size=140, num_attention_heads=5, num_key_value_heads=1, head_dim=16
)
# Heads of 32 (pairs in whole vectors): the prompt kernel serves them, so bfloat16 runs every step
# natively; widths with tails in every product.
_HEAD32: dict[str, Any] = dict(hidden_size=96, intermediate_size=200, head_dim=32)
MODELS: dict[str, tuple[type, Any]] = {
    "llama-odd-widths": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**_BASE, **_ODD)),
    "llama-gqa-mlp-bias": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(
            **_BASE,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            mlp_bias=True,
        ),
    ),
    "mistral-window12": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig(**_BASE, **_ODD, sliding_window=12),
    ),
    "llama-head32": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(**_BASE, **_HEAD32, num_attention_heads=3, num_key_value_heads=1),
    ),
    "mistral-head32-window12": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig(
            **_BASE, **_HEAD32, num_attention_heads=4, num_key_value_heads=2, sliding_window=12
        ),
    ),
    "qwen3-head32-bias": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config(
            **_BASE, **_HEAD32, num_attention_heads=3, num_key_value_heads=1, attention_bias=True
        ),
    ),
    # q/k/v biases.
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**_BASE, **_ODD)),
    # Per-head q/k norms; with attention_bias, biases on q/k/v and o.
    "qwen3-attention-bias": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config(**_BASE, **_ODD, attention_bias=True),
    ),
}
PROMPT = [(7 * i + 3) % 256 for i in range(30)]
MAX_TOKENS = 16


def _save(name: str, path: Path) -> Path:
    cls, config = MODELS[name]
    torch.manual_seed(0)
    model = cls(config)
    # transformers initializes biases to 0 and norm weights to 1, which would hide a path that
    # skips either.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(1.0 if "norm" in param_name else 0.0, 0.2)
    model.save_pretrained(path)
    return path


def _runner(model_dir: Path, tmp_path: Path, dtype: str = "bfloat16") -> ModelRunner:
    base = make_config(model_dir)
    config = EngineConfig(
        model_config=ModelConfig(model=str(model_dir), dtype=dtype, max_model_len=128),
        scheduler_config=base.scheduler_config,
        cache_config=base.cache_config,
        compilation_config=CompilationConfig(cache_dir=str(tmp_path / "compile-cache")),
        optimization_level=2,
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(64)
    return runner


def _generate(
    runner: ModelRunner, req_id: str = "a", prompt: list[int] = PROMPT
) -> tuple[list[int], list[float]]:
    driver = RunnerDriver(runner, num_blocks=64)
    driver.add(req_id, prompt, MAX_TOKENS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0))
    tokens = driver.run()[req_id]
    logprobs = [lp.logprobs[0][0] for out in driver.outputs for lp in out.logprobs if lp is not None]
    return tokens, logprobs


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        *(pytest.param(name, "bfloat16", marks=needs_native) for name in MODELS),
        pytest.param("llama-odd-widths", "float32", marks=needs_native_f32),
        pytest.param("qwen3-attention-bias", "float32", marks=needs_native_f32),
    ],
)
def test_native_decode_matches_transformers(name: str, dtype: str, tmp_path: Path) -> None:
    model_dir = _save(name, tmp_path / name)
    runner = _runner(model_dir, tmp_path, dtype)
    forward = runner._forward
    assert isinstance(forward, CompiledForward) and forward.native is not None
    native = forward.native
    with pytest.MonkeyPatch.context() as mp:
        served = count_served(mp, native)
        tokens, logprobs = _generate(runner)
    # Every one-token step ran natively, and the prompt's too where the native body runs every step.
    steps = MAX_TOKENS if native.every_step else MAX_TOKENS - 1
    assert served == [True] * steps

    # bfloat16 rounding differs between implementations, and random tiny models have near-ties it
    # can flip, after which two greedy runs part ways: each run is checked against transformers
    # (float32) on its own tokens instead. Every pick is the reference's best or within TIE of it,
    # with the reference's logprob.
    _check_against_reference(model_dir, tokens, logprobs)
    # New caches (bound to every layer anew): the native path follows them.
    runner.initialize_kv_cache(64)
    other = PROMPT[::-1]
    with pytest.MonkeyPatch.context() as mp:
        served = count_served(mp, native)
        _check_against_reference(model_dir, *_generate(runner, "c", other), prompt=other)
    assert served == [True] * steps
    forward.native = None
    _check_against_reference(model_dir, *_generate(runner, "b"))  # the graphs pass the same bar


def test_avx2_build_decodes_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 build's float32 products (8-float vectors, four accumulators a row), whatever this
    machine has (an AVX-512 machine's own build takes its 16-lane products)."""
    with forced_flag_set(monkeypatch, "avx2"):
        assert llama_decode.supports_dtype(torch.float32)
        test_native_decode_matches_transformers("llama-odd-widths", "float32", tmp_path)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        *(
            pytest.param(name, "bfloat16", marks=needs_native)
            for name in ("mistral-window12", "qwen3-attention-bias")
        ),
        pytest.param("mistral-window12", "float32", marks=needs_native_f32),
        pytest.param("qwen3-attention-bias", "float32", marks=needs_native_f32),
    ],
)
def test_several_sequences_decode_in_one_native_call(name: str, dtype: str, tmp_path: Path) -> None:
    """Three sequences decoding together: each step's three tokens (at three positions, over three
    block tables) run in one native call, each row rotated, normed and attended on its own."""
    model_dir = _save(name, tmp_path / name)
    runner = _runner(model_dir, tmp_path, dtype)
    native = runner._forward.native
    assert native is not None and native.max_rows == 8
    served: list[tuple[int, bool]] = []
    original_call = type(native).__call__

    def counting(self: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        out = original_call(self, input_ids, positions)
        served.append((input_ids.shape[0], out is not None))
        return out

    prompts = {"a": PROMPT, "b": PROMPT[::-1][:19], "c": [(5 * i + 1) % 256 for i in range(14)]}
    driver = RunnerDriver(runner, num_blocks=64)
    for req_id, prompt in prompts.items():
        driver.add(
            req_id, prompt, MAX_TOKENS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(native), "__call__", counting)
        tokens = driver.run()
    assert served == [(3, True)] * (MAX_TOKENS - 1)
    for req_id, prompt in prompts.items():
        logprobs = [
            lp.logprobs[0][0]
            for out in driver.outputs
            for i, lp in enumerate(out.logprobs or [])
            if lp is not None and out.req_ids[i] == req_id
        ]
        _check_against_reference(model_dir, tokens[req_id], logprobs, prompt=prompt)



def _logprobs_of(driver: RunnerDriver, req_id: str) -> list[float]:
    """The logprob of each token sampled for `req_id`, in order."""
    return [
        lp.logprobs[0][0]
        for out in driver.outputs
        for i, lp in enumerate(out.logprobs or [])
        if lp is not None and out.req_ids[i] == req_id
    ]


@needs_every_step
@pytest.mark.parametrize("name", ["llama-head32", "mistral-head32-window12", "qwen3-head32-bias"])
def test_a_token_is_computed_the_same_in_any_step(name: str, tmp_path: Path) -> None:
    """Every step runs in the native body, and a token's logprob is bitwise the same whether it was
    decoded alone, decoded beside other requests (prompt chunks and decode rows in the same steps),
    or scored as a prompt token: in one whole prompt or in chunks of a few tokens (each a short
    segment, as a prefix-cache hit's tail is)."""
    model_dir = _save(name, tmp_path / name)
    runner = _runner(model_dir, tmp_path)
    native = runner._forward.native
    assert native is not None and native.every_step
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    with pytest.MonkeyPatch.context() as mp:
        served = count_served(mp, native)
        alone = RunnerDriver(runner, num_blocks=64)
        alone.add("a", PROMPT, MAX_TOKENS, greedy)
        tokens = alone.run()["a"]
        decoded = _logprobs_of(alone, "a")

        crowd = RunnerDriver(runner, num_blocks=64, chunk_size=11, seed=1)
        crowd.add("x", PROMPT[::-1], MAX_TOKENS // 2, greedy)
        crowd.add("b", PROMPT, MAX_TOKENS, greedy)
        crowd.add("y", [(3 * i + 5) % 256 for i in range(40)], MAX_TOKENS, greedy)
        assert crowd.run()["b"] == tokens
        assert _logprobs_of(crowd, "b") == decoded

        # The same tokens as one prompt: its prompt logprobs are the decode steps' logprobs.
        scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        for chunk in (10**9, 5, 3):
            whole = RunnerDriver(runner, num_blocks=64, chunk_size=chunk)
            whole.add(f"p{chunk}", PROMPT + tokens, 1, scored)
            whole.run()
            prompt_lps = [
                lp
                for out in whole.outputs
                for lists in out.prompt_logprobs.values()
                if lists is not None
                for lp in (entry[0] for entry in lists.logprobs)
            ]
            assert prompt_lps[len(PROMPT) - 1 :] == decoded, chunk
    assert served and all(served)


TIE = 0.15


def _check_against_reference(
    model_dir: Path, tokens: list[int], logprobs: list[float], prompt: list[int] = PROMPT
) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
    ref = ref[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    chosen = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert torch.all(ref.max(-1).values - chosen <= TIE), (ref.max(-1).values - chosen).tolist()
    torch.testing.assert_close(torch.tensor(logprobs), chosen, atol=TIE, rtol=0)


@needs_native_f32
def test_models_the_path_cannot_run_keep_the_graphs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save("llama-gqa-mlp-bias", tmp_path / "llama")
    with caplog.at_level(logging.INFO, logger="pagedllm.compile"):
        runner = _runner(tmp_path / "llama", tmp_path, "float16")
    assert isinstance(runner._forward, CompiledForward) and runner._forward.native is None
    assert "single-sequence decode steps run the compiled graphs" in caplog.text
    assert "not all float32 or all bfloat16" in caplog.text
    tokens, _ = _generate(runner)
    assert len(tokens) == MAX_TOKENS


@needs_native_f32
@pytest.mark.parametrize(("token", "position", "status"), [(10, 0, -4), (-1, 0, -4), (3, 4, -5), (3, -1, -5)])
def test_token_or_position_outside_its_table_is_refused(token: int, position: int, status: int) -> None:
    """The C entry checks the token id against the vocabulary and the position against the rotary
    table before it reads either (the caller raises IndexError on these statuses)."""
    lib = llama_decode._library()
    assert lib is not None
    model = LlamaModel(hidden=16, intermediate=32, num_heads=1, num_kv_heads=1, head_size=16)
    model.num_layers, model.vocab, model.eps = 1, 10, 1e-6
    ids, positions = torch.tensor([token]), torch.tensor([position])
    args = (ctypes.byref(model), ids.data_ptr(), positions.data_ptr(), 1, None, 4, *[None] * 5)
    assert lib.decode_step_f32(*args) == status


class _Opaque(LinearMethodBase):
    """A method whose product is neither a plain dense matrix nor declares a native one: no
    `dense_weight`, no `native_matvec`."""

    def create_weights(self, *_: Any) -> None:
        raise AssertionError("not called: the layer already has its weights")

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise AssertionError("not called: only the selection runs")


def test_the_model_declares_the_path_and_its_layers_decide() -> None:
    """Llama-family models declare their decoder layers and native path; the path refuses layers whose
    linear method is not a plain dense product, whatever their class (runs without AVX-512: only
    the selection)."""
    _, config = MODELS["qwen3-attention-bias"]
    config.architectures = ["Qwen3ForCausalLM"]
    model = load_model(config, ".", load_format="dummy")
    assert isinstance(model, SupportsNativeDecode) and isinstance(model, HasDecoderLayers)
    assert list(model.decoder_layers()) == list(model.model.layers)
    assert llama_decode._unsupported(model) is None
    # An EAGLE-3 head reads intermediate streams, which the native call does not return.
    assert isinstance(model, SupportsEagle3)
    model.set_aux_hidden_state_layers([1])
    assert "EAGLE-3" in (llama_decode._unsupported(model) or "")
    model.set_aux_hidden_state_layers([])
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down, LinearBase)
    down.quant_method = _Opaque()
    assert "neither plain dense products nor declare a native product" in (
        llama_decode._unsupported(model) or ""
    )
    half = load_model(config, ".", load_format="dummy", dtype=torch.float16)
    assert "not all float32 or all bfloat16" in (llama_decode._unsupported(half) or "")
