"""The OpenAI-compatible server end to end: one real server process (SmolLM2), the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import httpx
import openai
import pytest
from openai.types import Completion
from remote_server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
T = TypeVar("T")


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(server: RemoteServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'^(vllm:\w+)\{model_name="([^"]*)"\} (\S+)$', line)
        if match and match.group(2) == MODEL_NAME:
            values[match.group(1)] = float(match.group(3))
    return values


def _tokenize(server: RemoteServer, **body: object) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


# ------------------------------------------------------------------------------------- basic routes
def test_models_health_version(server: RemoteServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_tokenize_detokenize_round_trip(server: RemoteServer) -> None:
    tokens = _tokenize(server, prompt=PROMPT)
    assert tokens
    response = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()
    assert response["prompt"] == PROMPT
    chat_tokens = _tokenize(server, messages=[{"role": "user", "content": "Hi"}])
    assert len(chat_tokens) > len(_tokenize(server, prompt="Hi"))


# ---------------------------------------------------------------------------------------- completions
def parallel(*calls: Callable[[], T]) -> list[T]:
    """Run requests at the same time: the engine batches them (and the tests take less time)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI) -> Completion:
    """The greedy completion of PROMPT, with logprobs; several tests compare against it."""
    return client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=3
    )


def test_greedy_completion_matches_offline_llm(greedy: Completion) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(max_model_len=512, optimization_level=0, kv_cache_memory_bytes=64 * 2**20)
    try:
        [offline] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert greedy.choices[0].text == offline.outputs[0].text
    assert greedy.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert greedy.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + greedy.usage.completion_tokens


def test_completion_prompt_forms_n_and_usage(
    server: RemoteServer, client: openai.OpenAI, greedy: Completion
) -> None:
    ids = _tokenize(server, prompt=PROMPT)
    from_ids, id_lists, batch, echoed, top_k = parallel(
        lambda: client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0),
        lambda: client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=8, temperature=0),
        lambda: client.completions.create(
            model=MODEL_NAME, prompt=[PROMPT, "Once upon a time"], max_tokens=4, n=2, temperature=0.8, seed=7,
            extra_body={"ignore_eos": True},
        ),
        lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, echo=True),
        # vLLM's extra sampling fields are applied: top_k=1 turns a very hot sampler into greedy decoding.
        lambda: client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=5.0, seed=0,
            extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0},
        ),
    )  # fmt: skip
    assert from_ids.choices[0].text == greedy.choices[0].text
    assert from_ids.usage.prompt_tokens == len(ids)
    assert [c.text for c in id_lists.choices] == [greedy.choices[0].text] * 2
    assert [c.index for c in id_lists.choices] == [0, 1]
    assert id_lists.usage.prompt_tokens == 2 * len(ids)
    assert echoed.choices[0].text == PROMPT + greedy.choices[0].text
    assert top_k.choices[0].text == greedy.choices[0].text
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in batch.choices)
    other_ids = _tokenize(server, prompt="Once upon a time")
    assert batch.usage.prompt_tokens == len(ids) + len(other_ids)
    assert batch.usage.completion_tokens == 4 * 4


def test_completion_logprobs(greedy: Completion) -> None:
    logprobs = greedy.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == greedy.usage.completion_tokens
    assert "".join(logprobs.tokens) == greedy.choices[0].text
    assert logprobs.text_offset[0] == 0
    for token, token_logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert token_logprob <= 0.0
        assert 3 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert top[token] == pytest.approx(max(top.values()))


def test_completion_echo_with_logprobs(
    server: RemoteServer, client: openai.OpenAI, greedy: Completion
) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, echo=True, logprobs=2
    )
    choice = response.choices[0]
    assert choice.text == PROMPT + greedy.choices[0].text
    logprobs = choice.logprobs
    num_prompt = len(_tokenize(server, prompt=PROMPT))
    assert len(logprobs.tokens) == num_prompt + response.usage.completion_tokens
    assert "".join(logprobs.tokens) == choice.text
    # Nothing predicts the first prompt token; every later one has its logprob and top candidates.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs[1:])
    assert all(token in top for token, top in zip(logprobs.tokens[1:], logprobs.top_logprobs[1:]))
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets
    # The generated part carries the same logprobs as without echo.
    assert logprobs.token_logprobs[num_prompt:] == pytest.approx(
        greedy.choices[0].logprobs.token_logprobs, abs=1e-3
    )


def test_completion_stop_string(client: openai.OpenAI, greedy: Completion) -> None:
    text = greedy.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    stopped = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop]
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> Callable[[], str]:
        def call() -> str:
            response = client.completions.create(
                model=MODEL_NAME, prompt="My favourite animal is", max_tokens=5, temperature=1.0, seed=seed,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return response.choices[0].text

        return call

    # The same seed gives the same text again, other seeds other texts. (Whether a request's draws
    # ignore its batch is tested at the runner in float32, tests/worker/test_model_runner.py: in
    # bfloat16 its logits alone and in a batch differ in the last bits, which can flip a draw.)
    alone = sample(1234)()
    assert sample(1234)() == alone
    batched = parallel(sample(1234), sample(1), sample(2))
    assert len(set(batched)) > 1


def test_streaming_completion_equals_full(client: openai.OpenAI, greedy: Completion) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [greedy.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == greedy.usage.prompt_tokens


# ------------------------------------------------------------------------------------------------ chat
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]},
]


def test_chat_full_and_streamed(server: RemoteServer, client: openai.OpenAI) -> None:
    full, chunks = parallel(
        lambda: client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0),
        lambda: list(
            client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
        ),
    )  # fmt: skip
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.usage.prompt_tokens == len(_tokenize(server, messages=MESSAGES))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # A stop string cuts the same greedy answer where it first occurs.
    content = message.content
    assert len(content) >= 3, content
    stop = content[len(content) // 2 :][:2]
    stopped = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == content[: content.index(stop)]


def test_chat_n_logprobs_and_token_limits(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4, n=2, temperature=1.0, seed=3,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    response, chunks = parallel(
        lambda: client.chat.completions.create(**kwargs),
        lambda: list(client.chat.completions.create(**kwargs, stream=True)),
    )
    # Seeded: the stream gives the same n answers, each choice with its own role chunk and logprobs.
    streamed: dict[int, str] = {}
    streamed_logprobs: dict[int, list[str]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None:
                streamed_logprobs.setdefault(c.index, []).extend(item.token for item in c.logprobs.content)
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert streamed == {c.index: c.message.content for c in response.choices}
    assert {i: "".join(tokens) for i, tokens in streamed_logprobs.items()} == streamed
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 8
    for choice in response.choices:
        assert choice.finish_reason == "length"
        content = choice.logprobs.content
        assert len(content) == 4
        assert "".join(item.token for item in content) == choice.message.content
        for item in content:
            assert len(item.top_logprobs) == 2
            assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    capped = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0)
    assert capped.usage.completion_tokens == 3


def test_chat_template_override_and_generation_prompt(tool_server: RemoteServer) -> None:
    # A request's own template needs --trust-request-chat-template, which the shared tool server has.
    server = tool_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Bye"},
    ]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0,
        extra_body={"chat_template": template, "add_generation_prompt": False},
    )  # fmt: skip
    rendered = "system: Be brief.\nuser: Hello there\nassistant: Hi!\nuser: Bye\n"
    expected = _tokenize(server, prompt=rendered, add_special_tokens=False)
    assert response.usage.prompt_tokens == len(expected)
    # The generation prompt is on by default (checked through /tokenize, which renders the same way).
    with_prompt = _tokenize(server, messages=messages, chat_template=template)
    assert with_prompt == _tokenize(server, prompt=rendered + "assistant:", add_special_tokens=False)


# ------------------------------------------------------------------------------- concurrency, aborts
def test_64_concurrent_streams(server: RemoteServer) -> None:
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        stream = await aclient.completions.create(
            model=MODEL_NAME, prompt=f"Request number {i}:", max_tokens=3, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        return usage.completion_tokens, usage.prompt_tokens, text

    async def run_all() -> list[tuple[int, int, str]]:
        limits = httpx.Limits(max_connections=100)
        http = httpx.AsyncClient(limits=limits, timeout=300)
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", http_client=http) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert [r[0] for r in results] == [3] * 64
    for i, (_, prompt_tokens, _) in enumerate(results):
        assert prompt_tokens == len(_tokenize(server, prompt=f"Request number {i}:"))


def test_periodic_stats_log_line(server: RemoteServer) -> None:
    # The server runs with --log-stats-interval 1; earlier tests kept it busy for many intervals.
    lines = [line for line in server.log_text().splitlines() if "Avg generation throughput" in line]
    assert lines, server.log_tail()
    busy = [line for line in lines if not re.search(r"Avg generation throughput: 0\.0 ", line)]
    assert busy, lines[-5:]
    for part in ("Avg prompt throughput", "Running:", "Waiting:", "KV cache usage:"):
        assert part in busy[-1]


def _wait_idle(server: RemoteServer) -> dict[str, float]:
    """The metrics once no request runs and no KV block is in use (or after 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = _metrics(server)
        if metrics["vllm:kv_cache_usage_perc"] == 0 and metrics["vllm:num_requests_running"] == 0:
            break
        time.sleep(0.2)
    return metrics


def _aborted(server: RemoteServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_aborted_stream_frees_blocks(server: RemoteServer) -> None:
    aborted_before = _aborted(server)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines) if line]
        assert received
        assert _metrics(server)["vllm:kv_cache_usage_perc"] > 0
    # Closing the connection aborts the request: its blocks go back to the pool.
    metrics = _wait_idle(server)
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:generation_tokens_total"] > 0
    assert metrics["vllm:time_to_first_token_seconds_count"] > 0
    assert _aborted(server) == aborted_before + 1

    # A client that gives up on a non-streaming request (here: a read timeout) aborts it too.
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1))
    metrics = _wait_idle(server)
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert metrics["vllm:num_requests_running"] == 0
    assert _aborted(server) == aborted_before + 2


# ----------------------------------------------------------------------------------------------- errors
def _error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["param"] == param, error
    return error["message"]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert "no-such-model" in str(info.value)


def test_length_errors_name_parameter_and_numbers(server: RemoteServer) -> None:
    url = f"{server.url}/v1/completions"
    long_prompt = list(range(100, 700))
    message = _error(httpx.post(url, json={"prompt": long_prompt, "max_tokens": 1}), 400, "prompt")
    assert "600" in message and "512" in message
    message = _error(httpx.post(url, json={"prompt": PROMPT, "max_tokens": 1000}), 400, "max_tokens")
    assert "1000" in message and "512" in message
    chat = {"messages": [{"role": "user", "content": "hi " * 600}], "max_tokens": 4}
    message = _error(httpx.post(f"{server.url}/v1/chat/completions", json=chat), 400, "messages")
    assert "512" in message
    # The limit is named as the client gave it, with the room left in the context.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat)
    message = _error(response, 400, "max_completion_tokens")
    room = 512 - len(_tokenize(server, messages=chat["messages"]))
    assert "1000" in message and "512" in message and str(room) in message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ({"prompt": PROMPT, "stop": 5}, "stop"),
        ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
        ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": PROMPT, "top_k": -5}, "top_k"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": [100, 10**7]}, "prompt"),
    ],
)
def test_completion_validation_errors(server: RemoteServer, body: dict[str, object], param: str) -> None:
    message = _error(httpx.post(f"{server.url}/v1/completions", json=body), 400, param)
    # No pydantic internals leak into the message.
    assert "pydantic" not in message and "errors.pydantic.dev" not in message and "loc" not in message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for %}"}, "chat_template"),
        ({"messages": [{"role": "user", "content": "x"}], "stream_options": {}}, "stream_options"),
    ],
)
def test_chat_validation_errors(server: RemoteServer, body: dict[str, object], param: str) -> None:
    _error(httpx.post(f"{server.url}/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": "x"}, "messages"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, "add_special_tokens"),
        ("/tokenize", [1, 2], None),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_tokenization_errors(server: RemoteServer, route: str, body: object, param: str | None) -> None:
    message = _error(httpx.post(f"{server.url}{route}", json=body), 400, param)
    assert "Request" not in message  # no schema class names


def test_unknown_route_and_method_in_openai_shape(server: RemoteServer) -> None:
    _error(httpx.get(f"{server.url}/v1/no-such-route"), 404, None)
    response = httpx.get(f"{server.url}/v1/completions")
    _error(response, 405, None)
    assert "POST" in response.headers["allow"]


def test_malformed_json_is_400(server: RemoteServer) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    _error(response, 400, None)


def test_no_api_key_needed_when_none_set(client: openai.OpenAI) -> None:
    bare = openai.OpenAI(base_url=client.base_url, api_key="anything", max_retries=0)
    assert bare.models.list().data


# ---------------------------------------------------------------------------- shutdown (keep last)
def test_sigint_without_grace_aborts_and_exits(server: RemoteServer) -> None:
    """Last test of the module: it stops the shared server."""
    chunks: list[str] = []

    def long_stream() -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": "Count:",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response,
        ):
            for line in response.iter_lines():
                if line:
                    chunks.append(line)

    thread = threading.Thread(target=long_stream)
    thread.start()
    deadline = time.monotonic() + 60
    while not chunks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert chunks, server.log_tail()
    # Ctrl-C in a terminal: SIGINT to the whole process group. shutdown_timeout defaults to 0: the request
    # is aborted at once, with an error event, and the server exits with 0; the engine core ignored the
    # group's signal and was stopped by the server.
    server.send_group_signal(signal.SIGINT)
    assert server.wait(60) == 0, server.log_tail()
    thread.join(30)
    assert not thread.is_alive()
    assert chunks[-1] == "data: [DONE]" and "shutting down" in chunks[-2]
    assert server.leftover_children() == []
    log = server.log_text()
    assert "Traceback" not in log and "leaked semaphore" not in log and "died" not in log, log[-4000:]
