"""vLLM's request semantics over HTTP: refused fields name themselves, prompt truncation, request ids,
chat roles (one server shared with the other vLLM-conformance modules)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from invariance import bitwise_here
from remote_server import RemoteServer

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
# Two requests over the same prompt may run it in different batches, or from the prefix cache: in bf16
# (the default on AVX-512-BF16 CPUs) a logprob moves by up to ~0.15 between such runs. A token off by
# one position would be off by whole units.
BF16_TOL = 0.25


def _post(server: RemoteServer, route: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=120)


def _ok(response: httpx.Response) -> dict[str, object]:
    assert response.status_code == 200, response.text
    return response.json()


def _bad(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def _tokenize(server: RemoteServer, **body: object) -> list[int]:
    return _ok(_post(server, "/tokenize", body))["tokens"]  # type: ignore[return-value]


# ------------------------------------------------------------------------- fields that would do nothing
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", 1),  # the server schedules first come, first served
        ("cache_salt", "s3cret"),
        ("thinking_token_budget", 10),
        ("logprob_token_ids", [5]),
        ("repetition_detection", {"max_pattern_size": 4}),
        ("session_id", "abc"),
        ("stream_interval", 4),
    ],
)
def test_fields_without_effect_are_refused_by_name(
    vllm_flags_server: RemoteServer, route: str, field: str, value: object
) -> None:
    body: dict[str, object] = {"max_tokens": 2, field: value}
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES})
    _bad(_post(vllm_flags_server, route, body), field)
    # The values that ask for nothing are taken (clients send defaults explicitly).
    neutral = {"priority": 0, "thinking_token_budget": -1, "stream_interval": 1}
    if field in neutral:
        _ok(_post(vllm_flags_server, route, {**body, field: neutral[field]}))


# ----------------------------------------------------------------------------------- prompt truncation
def test_truncate_prompt_tokens_keeps_the_prompts_end(vllm_flags_server: RemoteServer) -> None:
    ids = list(range(1000, 1600))  # 600 tokens: more than the 512-token context
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "temperature": 0, "truncate_prompt_tokens": 100}
    response = _ok(_post(vllm_flags_server, "/v1/completions", body))
    assert response["usage"]["prompt_tokens"] == 100  # type: ignore[index]
    echoed = response["choices"][0]["text"]  # type: ignore[index]
    kept = _ok(_post(vllm_flags_server, "/detokenize", {"tokens": ids[-100:]}))["prompt"]
    assert echoed.startswith(kept)  # type: ignore[union-attr]
    right = _ok(_post(vllm_flags_server, "/v1/completions", {**body, "truncation_side": "right"}))
    first = _ok(_post(vllm_flags_server, "/detokenize", {"tokens": ids[:100]}))["prompt"]
    assert right["choices"][0]["text"].startswith(first)  # type: ignore[index]
    # A text prompt longer than the context is cut the same way.
    text = "word " * 2000
    response = _ok(
        _post(
            vllm_flags_server,
            "/v1/completions",
            {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 50},
        )
    )
    assert response["usage"]["prompt_tokens"] == 50  # type: ignore[index]
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "truncate_prompt_tokens": 60}
    assert _ok(_post(vllm_flags_server, "/v1/chat/completions", chat))["usage"]["prompt_tokens"] == 60  # type: ignore[index]
    too_many = {"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": 513}
    assert "512" in _bad(_post(vllm_flags_server, "/v1/completions", too_many), "truncate_prompt_tokens")


# ----------------------------------------------------------------------------------------- request ids
def test_request_id_names_the_response(vllm_flags_server: RemoteServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "request_id": "my-trace-7"}

    def complete(_: int) -> str:
        return _ok(_post(vllm_flags_server, "/v1/completions", body))["id"]  # type: ignore[return-value]

    # Two requests in flight under one id both run (the engine's own ids stay unique).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(complete, range(2))) == ["cmpl-my-trace-7", "cmpl-my-trace-7"]
    chat = {"messages": MESSAGES, "max_tokens": 2, "request_id": "abc"}
    assert _ok(_post(vllm_flags_server, "/v1/chat/completions", chat))["id"] == "chatcmpl-abc"


# ---------------------------------------------------------------------------------------------- roles
def test_developer_role_is_the_system_prompt_of_a_template_without_it(
    vllm_flags_server: RemoteServer,
) -> None:
    def conversation(role: str) -> list[dict[str, str]]:
        return [{"role": role, "content": "Answer in French."}, *MESSAGES]

    developer = _tokenize(vllm_flags_server, messages=conversation("developer"))
    assert developer == _tokenize(vllm_flags_server, messages=conversation("system"))
    reply = _ok(
        _post(
            vllm_flags_server,
            "/v1/chat/completions",
            {"max_tokens": 2, "messages": conversation("developer")},
        )
    )
    assert reply["usage"]["prompt_tokens"] == len(developer)  # type: ignore[index]


def test_custom_roles_reach_the_chat_template(vllm_flags_server: RemoteServer) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    messages = [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "upon"}]
    tokens = _tokenize(vllm_flags_server, messages=messages, chat_template=template)
    text = _ok(_post(vllm_flags_server, "/detokenize", {"tokens": tokens}))["prompt"]
    assert text == "<narrator>Once<user>upon"
    body = {"messages": messages, "chat_template": template, "max_tokens": 2}
    _ok(_post(vllm_flags_server, "/v1/chat/completions", body))


# ----------------------------------------------------------------------------- vLLM's front-end flags
def test_prompt_tokens_details_count_prefix_cache_hits(vllm_flags_server: RemoteServer) -> None:
    body = {"prompt": "Once upon a time, in a land far away, " * 12, "max_tokens": 1}
    _ok(_post(vllm_flags_server, "/v1/completions", body))
    usage = _ok(_post(vllm_flags_server, "/v1/completions", body))["usage"]
    # The second time the prompt's full blocks come from the prefix cache (not its last token, which
    # must be computed to sample from).
    cached = usage["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
    assert 0 < cached < usage["prompt_tokens"]  # type: ignore[index]
    chat = {"messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": 1}
    _ok(_post(vllm_flags_server, "/v1/chat/completions", chat))
    usage = _ok(_post(vllm_flags_server, "/v1/chat/completions", chat))["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]  # type: ignore[index]


def test_load_counts_requests_in_flight(vllm_flags_server: RemoteServer) -> None:
    assert _ok(httpx.get(f"{vllm_flags_server.url}/load")) == {"server_load": 0}
    body = {"prompt": PROMPT, "max_tokens": 40, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{vllm_flags_server.url}/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        # A stream counts until its last byte is sent.
        assert _ok(httpx.get(f"{vllm_flags_server.url}/load")) == {"server_load": 1}
        list(lines)  # read to the end
    assert _ok(httpx.get(f"{vllm_flags_server.url}/load")) == {"server_load": 0}


def test_tokenizer_info(vllm_flags_server: RemoteServer, smollm2_gguf: object) -> None:
    from pagedllm.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(smollm2_gguf)
    info = _ok(httpx.get(f"{vllm_flags_server.url}/tokenizer_info"))
    assert info["tokenizer_class"] == type(tokenizer).__name__
    # What a remote-tokenizer client (lm-evaluation-harness) renders chats with.
    assert info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token


def test_request_id_headers(vllm_flags_server: RemoteServer) -> None:
    given = httpx.get(f"{vllm_flags_server.url}/v1/models", headers={"X-Request-Id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    made = httpx.get(f"{vllm_flags_server.url}/v1/models").headers["x-request-id"]
    assert len(made) >= 16


def test_tokens_as_token_ids(vllm_flags_server: RemoteServer) -> None:
    prompt_ids = _tokenize(vllm_flags_server, prompt=PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}
    choice = _ok(_post(vllm_flags_server, "/v1/completions", body))["choices"][0]  # type: ignore[index]
    tokens = choice["logprobs"]["tokens"]
    assert tokens[: len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    generated = [int(t.removeprefix("token_id:")) for t in tokens[len(prompt_ids) :]]
    text = _ok(_post(vllm_flags_server, "/detokenize", {"tokens": generated}))["prompt"]
    assert choice["text"] == PROMPT + text
    # A request may ask for text tokens on this server.
    plain = _ok(_post(vllm_flags_server, "/v1/completions", {**body, "return_tokens_as_token_ids": False}))
    assert "".join(plain["choices"][0]["logprobs"]["tokens"]) == choice["text"]  # type: ignore[index]
    chat = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
    content = _ok(_post(vllm_flags_server, "/v1/chat/completions", chat))["choices"][0]["logprobs"]["content"]  # type: ignore[index]
    assert all(entry["token"].startswith("token_id:") for entry in content)


def test_default_chat_template_kwargs(vllm_flags_server: RemoteServer) -> None:
    template = "{{ greeting }}:{% for m in messages %}{{ m.content }}{% endfor %}"

    def rendered(**extra: object) -> str:
        tokens = _tokenize(vllm_flags_server, messages=MESSAGES, chat_template=template, **extra)
        return _ok(_post(vllm_flags_server, "/detokenize", {"tokens": tokens}))["prompt"]  # type: ignore[return-value]

    assert rendered() == "Ahoy:Name a colour."
    assert rendered(chat_template_kwargs={"greeting": "Hi"}) == "Hi:Name a colour."


# -------------------------------------------------------------------------------- request features
def test_prompt_logprobs(vllm_flags_server: RemoteServer) -> None:
    prompt_ids = _tokenize(vllm_flags_server, prompt=PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2, "return_tokens_as_token_ids": False}
    rows = _ok(_post(vllm_flags_server, "/v1/completions", body))["choices"][0]["prompt_logprobs"]  # type: ignore[index]
    assert len(rows) == len(prompt_ids) and rows[0] is None
    for token_id, row in zip(prompt_ids[1:], rows[1:]):
        # The prompt's own token, and the 2 most likely ones (ranked 1 and 2).
        assert str(token_id) in row and {1, 2} <= {entry["rank"] for entry in row.values()}
        assert all(entry["logprob"] <= 0 for entry in row.values())
    # The echo's logprobs are the same numbers in OpenAI's legacy shape.
    echo = {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 2}
    legacy = _ok(_post(vllm_flags_server, "/v1/completions", echo))["choices"][0]["logprobs"]  # type: ignore[index]
    for token_id, row, logprob in zip(prompt_ids[1:], rows[1:], legacy["token_logprobs"][1:]):
        assert row[str(token_id)]["logprob"] == pytest.approx(logprob, rel=0.02, abs=BF16_TOL)
    chat = {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}
    response = _ok(_post(vllm_flags_server, "/v1/chat/completions", chat))
    assert len(response["prompt_logprobs"]) == response["usage"]["prompt_tokens"]  # type: ignore[index]
    streamed = _post(vllm_flags_server, "/v1/completions", {**body, "stream": True})
    _bad(streamed, "prompt_logprobs")


def test_lm_eval_loglikelihood_requests(vllm_flags_server: RemoteServer) -> None:
    """lm-evaluation-harness' local-completions model: a batch of tokenized context+continuation
    prompts, echoed with logprobs, each continuation scored from the prompt's own token logprobs."""
    contexts = [_tokenize(vllm_flags_server, prompt=c) for c in ("The capital of France is", "2 + 2 =")]
    continuations = [
        _tokenize(vllm_flags_server, prompt=c, add_special_tokens=False) for c in (" Paris", " 4")
    ]
    prompts = [ctx + cont for ctx, cont in zip(contexts, continuations)]
    payload = {"model": "SmolLM2-135M-Instruct", "prompt": prompts, "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    choices = sorted(
        _ok(_post(vllm_flags_server, "/v1/completions", payload))["choices"], key=lambda c: c["index"]
    )  # type: ignore[arg-type]
    # max_tokens 0: the same prompt logprobs, without the one sampled token.
    no_gen = sorted(
        _ok(_post(vllm_flags_server, "/v1/completions", {**payload, "max_tokens": 0}))["choices"],
        key=lambda c: c["index"],
    )  # type: ignore[arg-type]
    for choice, bare, prompt, ctx in zip(choices, no_gen, prompts, contexts):
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == len(prompt) + 1
        assert bare["logprobs"]["token_logprobs"] == pytest.approx(
            token_logprobs[:-1], rel=0.02, abs=BF16_TOL
        )
        # lm-eval's parse_logprobs: the continuation's logprobs, and whether greedy decoding picks it.
        ctxlen = len(ctx)
        loglikelihood = sum(token_logprobs[ctxlen:-1])
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert all(top is not None and len(top) >= 1 for top in tops)
        # The same numbers as prompt_logprobs give for the continuation's tokens.
        rows = _ok(
            _post(
                vllm_flags_server,
                "/v1/completions",
                {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0},
            )
        )["choices"][0]["prompt_logprobs"]  # type: ignore[index]
        expected = sum(rows[i][str(prompt[i])]["logprob"] for i in range(ctxlen, len(prompt)))
        assert loglikelihood == pytest.approx(expected, rel=0.02, abs=BF16_TOL) and loglikelihood < 0


def test_chat_echo_continues_the_last_message(vllm_flags_server: RemoteServer) -> None:
    messages = [
        {"role": "user", "content": "Say a colour."},
        {"role": "assistant", "content": "My colour is"},
    ]
    # The stream must carry the echo and the continuation as the answer has them. The second request's
    # prompt comes from the prefix cache: its greedy tokens are the first's where the server is batch-
    # invariant (bfloat16, -O0 included: README, Reproducibility); elsewhere (float32) later tokens
    # may move with the rounding, so one token is compared there.
    max_tokens = 12 if bitwise_here() else 1
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    full = _ok(_post(vllm_flags_server, "/v1/chat/completions", body))["choices"][0]["message"]  # type: ignore[index]
    # The answer continues the assistant's message: its role, its text first.
    assert full["role"] == "assistant" and full["content"].startswith("My colour is")
    assert len(full["content"]) > len("My colour is")
    chunks = _stream_chunks(vllm_flags_server, "/v1/chat/completions", body)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == full["content"]
    # After a generation prompt the answer is a new message: nothing is echoed.
    fresh = {**body, "add_generation_prompt": True, "continue_final_message": False, "messages": MESSAGES}
    content = _ok(_post(vllm_flags_server, "/v1/chat/completions", fresh))["choices"][0]["message"]["content"]  # type: ignore[index]
    assert not content.startswith("Name a colour")


def _stream_chunks(server: RemoteServer, route: str, body: dict[str, object]) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{route}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_chat_opens_with_the_first_token(vllm_flags_server: RemoteServer) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 3,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = _stream_chunks(vllm_flags_server, "/v1/chat/completions", body)
    first = chunks[0]
    assert (first["choices"][0]["delta"]["role"], first["choices"][0]["delta"]["content"]) == (
        "assistant",
        "",
    )
    # The opening chunk leaves once the model has run the prompt: it already counts the prompt's tokens.
    prompt_tokens = len(_tokenize(vllm_flags_server, messages=MESSAGES))
    assert (first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]) == (prompt_tokens, 0)
    assert all(chunk["usage"] is not None for chunk in chunks)


def test_invocations_routes_by_body_shape(vllm_flags_server: RemoteServer) -> None:
    chat = _ok(_post(vllm_flags_server, "/invocations", {"messages": MESSAGES, "max_tokens": 2}))
    assert chat["object"] == "chat.completion"
    completion = _ok(_post(vllm_flags_server, "/invocations", {"prompt": PROMPT, "max_tokens": 2}))
    assert completion["object"] == "text_completion"
    response = _post(vllm_flags_server, "/invocations", {"input": "embed me"})
    assert response.status_code == 400 and "ChatCompletionRequest" in response.json()["error"]["message"]


def test_tokenize_token_strs(vllm_flags_server: RemoteServer, smollm2_gguf: object) -> None:
    from pagedllm.tokenizer import get_tokenizer

    response = _ok(_post(vllm_flags_server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}))
    tokenizer = get_tokenizer(smollm2_gguf)
    assert response["token_strs"] == tokenizer.convert_ids_to_tokens(response["tokens"])
    assert _ok(_post(vllm_flags_server, "/tokenize", {"prompt": PROMPT}))["token_strs"] is None


# ------------------------------------------------------------------------------------------- metrics
def _metric_samples(server: RemoteServer) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_vllm_metric_set(vllm_flags_server: RemoteServer) -> None:
    before = _metric_samples(vllm_flags_server)
    _ok(_post(vllm_flags_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "n": 3}))
    after = _metric_samples(vllm_flags_server)

    def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
        return sum(value for _, value in samples.get(name, []))

    # One request of n=3 and max_tokens=5: n observed once, max_tokens once per choice.
    assert total(after, "vllm:request_params_n_count") - total(before, "vllm:request_params_n_count") == 1
    assert total(after, "vllm:request_params_n_sum") - total(before, "vllm:request_params_n_sum") == 3
    grown = total(after, "vllm:request_params_max_tokens_sum") - total(
        before, "vllm:request_params_max_tokens_sum"
    )
    assert grown == 15
    assert total(after, "vllm:request_max_num_generation_tokens_count") > total(
        before, "vllm:request_max_num_generation_tokens_count"
    )
    [(labels, value)] = after["vllm:cache_config_info"]
    assert value == 1 and labels["block_size"] == "16" and int(labels["num_gpu_blocks"]) > 0
    states = {labels["sleep_state"]: value for labels, value in after["vllm:engine_sleep_state"]}
    assert states == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    for name in ("vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_total",
                 "vllm:request_prefill_kv_computed_tokens_count"):  # fmt: skip
        assert name in after, name


# -------------------------------------------------------------------------------------- beam search
def test_beam_search_over_http(vllm_flags_server: RemoteServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 3, "use_beam_search": True, "logprobs": 0,
            "return_tokens_as_token_ids": False}  # fmt: skip
    choices = _ok(_post(vllm_flags_server, "/v1/completions", body))["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]  # type: ignore[union-attr]
    texts = [c["text"] for c in choices]  # type: ignore[union-attr]
    assert len(set(texts)) == 3
    # Best first: each beam's score is the sum of its tokens' logprobs (length_penalty 1, same length).
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]  # type: ignore[union-attr]
    assert sums == sorted(sums, reverse=True)
    chat = {"messages": MESSAGES, "max_tokens": 3, "n": 2, "use_beam_search": True}
    chat_choices = _ok(_post(vllm_flags_server, "/v1/chat/completions", chat))["choices"]
    assert (
        len(chat_choices) == 2
        and chat_choices[0]["message"]["content"] != chat_choices[1]["message"]["content"]
    )  # type: ignore[index]
    streamed = _stream_chunks(
        vllm_flags_server, "/v1/completions", {k: v for k, v in body.items() if k != "logprobs"}
    )
    assert sorted(c["choices"][0]["text"] for c in streamed if c["choices"]) == sorted(texts)
    # What a beam search cannot honour is refused, not ignored.
    _bad(_post(vllm_flags_server, "/v1/completions", {**body, "top_p": 0.5}), "top_p")
    _bad(
        _post(vllm_flags_server, "/v1/completions", {"prompt": PROMPT, "length_penalty": 2.0}),
        "length_penalty",
    )
    assert "max_logprobs" in _bad(_post(vllm_flags_server, "/v1/completions", {**body, "n": 11}), "n")
