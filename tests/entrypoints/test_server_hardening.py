"""The server against hostile or unusual clients: fields it does not implement, huge bodies, large n, lone
surrogates, request fields over their size limits, an unauthenticated /tokenize, constraints that take a
grammar engine minutes, a shutdown timeout expiring mid-stream; and vLLM's metric names.

One server for the module, with an API key, a small body limit, a small n cap, a lowered message limit,
and structured-output limits lifted (so that pathological constraints reach the grammar engine) with
short deadlines."""

from __future__ import annotations

import json
import random
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest
from remote_server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 4 * 1024 * 1024
MAX_N = 8
MAX_MESSAGES = 8
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Hi", "max_tokens": 2}
# Seconds: the front-end's budget for checking a constraint, the core's for compiling its grammar.
VALIDATION_TIMEOUT_S, COMPILE_TIMEOUT_S = 2, 2
STRUCTURED_OUTPUTS = {
    "max_schema_bytes": BODY_LIMIT,
    "max_enum_members": 10**6,
    "max_regex_repetition": 10**6,
    "validation_timeout_s": VALIDATION_TIMEOUT_S,
    "compile_timeout_s": COMPILE_TIMEOUT_S,
}


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    remote = RemoteServer(
        extra_args=[
            "--api-key", KEY, "--max-request-body-bytes", str(BODY_LIMIT), "--max-n-sequences", str(MAX_N),
            "--shutdown-timeout", "1", "--request-limit", f"messages={MAX_MESSAGES}",
            "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS),
        ]
    )  # fmt: skip
    try:
        yield remote
    finally:
        remote.kill()


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


def _error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (status, param), error
    return error["message"]


# ------------------------------------------------------------------------------- fields not implemented
UNSUPPORTED = [
    ("guided_decoding_backend", "xgrammar"),
    ("structural_tag", "{}"),
    ("cache_salt", "s"),
    ("logits_processors", ["x"]),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_fields_not_implemented_are_400(http: httpx.Client, route: str) -> None:
    base = COMPLETION if route == "/v1/completions" else CHAT
    for field, value in UNSUPPORTED:
        message = _error(http.post(route, json={**base, field: value}), 400, field)
        assert field in message and "not supported yet" in message
    # The values that ask for nothing are fine, as is the plain-text response format.
    neutral = {"response_format": {"type": "text"}, "use_beam_search": False, "guided_json": None}
    assert http.post(route, json={**base, **neutral}).status_code == 200


def test_chat_tools_auto_needs_the_server_flags(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    # No tool_choice with tools means "auto", which needs --enable-auto-tool-choice --tool-call-parser.
    message = _error(http.post("/v1/chat/completions", json={**CHAT, "tools": tools}), 400, "tool_choice")
    assert "--enable-auto-tool-choice" in message
    _error(http.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"}), 400, "tool_choice")
    response = http.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": "none"})
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------------------------ denial of service
def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    big = {"prompt": "a" * BODY_LIMIT}
    _error(http.post("/v1/completions", json=big), 413, None)

    # No Content-Length (chunked): the limit is counted as the body arrives.
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 65536 + 1):
            yield b"a" * 65536
        yield b'"}'

    response = http.post("/tokenize", content=chunks(), headers={"Content-Type": "application/json"})
    _error(response, 413, None)


def test_n_above_the_cap_is_400(http: httpx.Client) -> None:
    message = _error(http.post("/v1/completions", json={**COMPLETION, "n": MAX_N + 1}), 400, "n")
    assert str(MAX_N + 1) in message and str(MAX_N) in message
    _error(http.post("/v1/chat/completions", json={**CHAT, "n": 1000}), 400, "n")
    assert http.post("/v1/completions", json={**COMPLETION, "n": MAX_N}).status_code == 200


def test_tokenization_needs_the_api_key(server: RemoteServer) -> None:
    _error(httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}), 401, None)
    _error(httpx.post(f"{server.url}/detokenize", json={"tokens": [1]}), 401, None)
    # Probes and scrapers need no key.
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_tokenize_is_bounded_and_does_not_stall_health(server: RemoteServer, http: httpx.Client) -> None:
    # A text longer than any prompt the context could hold is refused before tokenizing (it built a
    # multi-million-token answer before).
    message = _error(http.post("/tokenize", json={"prompt": "hello " * 500_000}), 400, "prompt")
    bound = int(re.search(r"more than the (\d+) that could fit", message).group(1))  # type: ignore[union-attr]
    # Just within the bound, in CJK characters that tokenize byte by byte: a few hundred thousand tokens
    # and seconds of tokenizer work, off the event loop (/health waited for all of it before).
    rng = random.Random(0)
    text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(bound))
    result: dict[str, object] = {}

    def tokenize() -> None:
        response = http.post("/tokenize", json={"prompt": text})
        result["count"] = response.json().get("count")

    thread = threading.Thread(target=tokenize)
    thread.start()
    latencies: list[float] = []
    while thread.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    thread.join()
    assert isinstance(result["count"], int) and result["count"] > 100_000
    # Probes kept running while the tokenizer worked: blocked, the loop answers at most one probe before
    # the request lands and one after all of it (two in all); on a fast CPU the work takes ~0.3 s, so three
    # is the count that tells the two apart everywhere. The bound on the slowest leaves room for load.
    assert len(latencies) >= 3, latencies
    assert sorted(latencies)[len(latencies) // 2] < 0.5, latencies
    assert max(latencies) < 3.0, latencies


def test_prompt_longer_than_any_context_is_refused_before_tokenizing(http: httpx.Client) -> None:
    message = _error(http.post("/v1/completions", json={"prompt": "x " * 1_000_000}), 400, "prompt")
    assert "characters" in message and "512" in message


# ------------------------------------------------------------------------------------------- field sizes
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
OVER_LIMITS = [
    ("/v1/completions", {**COMPLETION, "stop": ["s"] * 65}, "stop"),
    ("/v1/completions", {**COMPLETION, "stop": "x" * 1025}, "stop"),
    ("/v1/completions", {"prompt": ["Hi"] * 2049, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": list(range(1025))}, "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": list(range(129))}, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "bad_words": ["w"] * 129}, "bad_words"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * (MAX_MESSAGES + 1)}, "messages"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL] * 129, "tool_choice": "none"}, "tools"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("route", "body", "param"), OVER_LIMITS)
def test_fields_over_their_size_limit_are_400(
    http: httpx.Client, route: str, body: dict[str, object], param: str
) -> None:
    _error(http.post(route, json=body), 400, param)


def test_request_limit_flag_sets_the_bound(http: httpx.Client) -> None:
    message = _error(
        http.post("/v1/chat/completions", json={**CHAT, "messages": CHAT["messages"] * 9}), 400, "messages"
    )
    assert "9 messages" in message and f"limit of {MAX_MESSAGES}" in message
    at_limit = {**CHAT, "messages": CHAT["messages"] * MAX_MESSAGES}
    assert http.post("/v1/chat/completions", json=at_limit).status_code == 200


# --------------------------------------------------------------------------------------- lone surrogates
@pytest.mark.parametrize(
    ("route", "raw", "param"),
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
        ("/tokenize", b'{"prompt": "\\udfff"}', "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ],
)
def test_lone_surrogate_is_400_and_keeps_the_connection(
    server: RemoteServer, route: str, raw: bytes, param: str
) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        response = client.post(route, content=raw, headers={"Content-Type": "application/json"})
        assert "surrogate" in _error(response, 400, param)
        assert response.headers.get("connection") != "close"
        # The same keep-alive connection serves the next request.
        assert client.post("/tokenize", json={"prompt": "ok"}).status_code == 200


# ---------------------------------------------------------------------------------------- error fields
def test_errors_name_the_chat_fields_the_client_set(http: httpx.Client) -> None:
    body = {**CHAT, "logprobs": True, "top_logprobs": 50}
    assert "top_logprobs" in _error(http.post("/v1/chat/completions", json=body), 400, "top_logprobs")
    body = {**CHAT, "max_completion_tokens": 1000}
    del body["max_tokens"]
    message = _error(http.post("/v1/chat/completions", json=body), 400, "max_completion_tokens")
    assert message.startswith("max_completion_tokens")


def test_request_chat_templates_are_refused_without_the_flag(http: httpx.Client) -> None:
    """A request's chat_template is neither rendered nor read as a path (it was: /tokenize echoed
    /etc/passwd); chat_template_kwargs cannot smuggle one in."""
    messages = CHAT["messages"]
    for template in (
        "/etc/passwd",
        "{{ messages[0].content }}",
        "{{ ().__class__.__base__.__subclasses__() }}",
    ):
        for route, body in (
            ("/v1/chat/completions", {**CHAT, "chat_template": template}),
            ("/tokenize", {"messages": messages, "chat_template": template}),
        ):
            message = _error(http.post(route, json=body), 400, "chat_template")
            assert "--trust-request-chat-template" in message and "root:" not in message
    kwargs = {"chat_template_kwargs": {"chat_template": "/etc/passwd"}}
    _error(http.post("/v1/chat/completions", json={**CHAT, **kwargs}), 400, "chat_template_kwargs")
    _error(http.post("/tokenize", json={"messages": messages, **kwargs}), 400, "chat_template_kwargs")


# ------------------------------------------------------------------------------------------------ metrics
VLLM_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
]  # fmt: skip
VLLM_MOVING = [
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
    "vllm:iteration_tokens_total_count",
]  # fmt: skip


def _scrape(server: RemoteServer) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        match = re.match(r'^(vllm:\w+)\{model_name="([^"]*)"\} (\S+)$', line)
        if match and match.group(2) == MODEL_NAME:
            values[match.group(1)] = float(match.group(3))
    return values


def test_metrics_under_vllm_names(server: RemoteServer, http: httpx.Client) -> None:
    before = _scrape(server)
    body = {**COMPLETION, "max_tokens": 4, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    after = _scrape(server)
    assert set(VLLM_METRICS) <= set(after), sorted(after)
    for name in VLLM_MOVING:
        assert after[name] > before.get(name, 0), name
    text = httpx.get(f"{server.url}/metrics").text
    assert re.search(
        r'^vllm:request_success_total\{finished_reason="length",model_name="[^"]+"\} ', text, re.M
    )


# ------------------------------------------------------------------- constraints that take minutes to compile
class HealthProbe:
    """Polls /health every 0.1 s in a thread; records each answer's latency."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            assert httpx.get(f"{self.url}/health", timeout=120).status_code == 200
            self.latencies.append(time.monotonic() - start)
            self._stop.wait(0.1)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(150)

    def check(self) -> None:
        # Blocked, the loop answered a probe only after the grammar engine finished (16 s to minutes);
        # the bound leaves room for a loaded machine.
        assert len(self.latencies) >= 5 and max(self.latencies) < 3.0, self.latencies


def _compile_servers(parent: psutil.Process) -> list[psutil.Process]:
    return [p for p in parent.children() if "pagedllm.structured_output.compile_server" in p.cmdline()]


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def test_a_schema_slow_to_check_is_refused_within_the_budget_and_its_check_is_killed(
    server: RemoteServer, http: httpx.Client
) -> None:
    # 90 bytes that xgrammar converts for half a minute (the conversion grows faster than the count: 1.5 s
    # for 5000 on a quiet Zen 5, 27 s for 20000): on the event loop before, nothing else ran meanwhile;
    # then in a thread of the server's, which went on converting (a core busy) long after the 400.
    slow = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[a-z]{1,20000}"}}}
    # A first constraint starts the server's compile server (it imports the grammar engines: not timed);
    # its check leaves one idle worker, the one the next check runs in.
    good = {**COMPLETION, "guided_choice": ["yes", "no"]}
    assert http.post("/v1/completions", json=good).status_code == 200
    api = server.psutil_proc
    compile_servers = _compile_servers(api)
    workers = [worker for process in compile_servers for worker in process.children()]
    answers: dict[str, httpx.Response] = {}

    def send_slow() -> None:
        answers["slow"] = http.post("/v1/chat/completions", json={**CHAT, "response_format": slow})

    with HealthProbe(server.url) as probe:
        start = time.monotonic()
        thread = threading.Thread(target=send_slow)
        thread.start()
        # Other requests are served while the constraint is being checked.
        answers["other"] = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 4}, timeout=60)
        thread.join(120)
        elapsed = time.monotonic() - start
        # Nothing of the check goes on after its 400: its worker was killed, and the server's own process
        # (which converted in a thread before: a core's worth while it got one, 0.5 s of 2 s at a load of
        # 7 per core) is idle but for the probes (0.02 s).
        _, alive = psutil.wait_procs(workers, timeout=5)
        cpu_before = _cpu_seconds(api)
        time.sleep(3)
        cpu_spent = _cpu_seconds(api) - cpu_before
    message = _error(answers["slow"], 400, "response_format")
    assert f"could not be checked within {VALIDATION_TIMEOUT_S} s" in message and elapsed < 30, (message, elapsed)
    assert "validation_timeout_s" in message
    assert answers["other"].status_code == 200, answers["other"].text
    assert cpu_spent < 0.2, cpu_spent
    assert len(compile_servers) == 1 and len(workers) == 1, (compile_servers, workers)
    assert alive == [], alive
    probe.check()
    # The next constraint is checked by a fresh worker of the same compile server.
    assert http.post("/v1/completions", json=good).status_code == 200
    assert _compile_servers(api) == compile_servers
    assert workers[0] not in compile_servers[0].children()


def _waiting_requests(server: RemoteServer) -> float:
    return _scrape(server).get("vllm:num_requests_waiting", 0.0)


def test_a_grammar_over_its_compile_deadline_fails_and_the_next_one_is_served(
    server: RemoteServer, http: httpx.Client
) -> None:
    # xgrammar compiles a 60,000-member enum for a minute or more (a 100,000-member one held a thread
    # over 10 minutes); two of them took both compile threads, and every later constrained request waited.
    def huge_enum(tag: str) -> dict:
        return {**COMPLETION, "guided_json": {"enum": [f"{tag}-{i}" for i in range(60_000)]}}

    answers: dict[str, httpx.Response] = {}

    def send(tag: str) -> None:
        answers[tag] = http.post("/v1/completions", json=huge_enum(tag))

    normal = {**COMPLETION, "max_tokens": 4, "guided_choice": ["yes", "no"]}
    # The first constrained request starts the compile workers' fork server (seconds): not timed here.
    assert http.post("/v1/completions", json=normal).status_code == 200
    threads = [threading.Thread(target=send, args=(tag,)) for tag in ("a", "b")]
    waiting = 0.0
    with HealthProbe(server.url) as probe:
        start = time.monotonic()
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            # Requests waiting for their grammar are waiting requests (vLLM's gauge).
            waiting = max(waiting, _waiting_requests(server))
            time.sleep(0.2)
        failed_after = time.monotonic() - start
        response = http.post("/v1/completions", json={**normal, "guided_choice": ["maybe", "no"]}, timeout=60)
        served_after = time.monotonic() - start
    for tag in ("a", "b"):
        message = _error(answers[tag], 400, "guided_json")
        assert f"structured_outputs.json did not compile within {COMPILE_TIMEOUT_S} s" in message, message
    assert response.status_code == 200 and response.json()["choices"][0]["text"] in ("maybe", "no"), response.text
    # Generous bounds for a loaded machine; far below the compile times.
    assert failed_after < 45 and served_after < 60, (failed_after, served_after)
    assert waiting >= 1
    probe.check()
    assert _waiting_requests(server) == 0


# ------------------------------------------------------------------------------- shutdown (keep last)
def test_shutdown_timeout_mid_stream_ends_with_an_error_event(server: RemoteServer) -> None:
    """Last test of the module: it stops the shared server (--shutdown-timeout 1)."""
    lines: list[str] = []
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    outcome: dict[str, str] = {}

    def long_stream() -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": "Count:",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
        outcome["raw"] = "complete"

    def openai_stream() -> None:
        try:
            for _ in client.completions.create(
                model=MODEL_NAME,
                prompt="Count:",
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                started.set()
            outcome["openai"] = "normally"
        except openai.APIError as e:
            outcome["openai"] = str(e)

    started = threading.Event()
    threads = [threading.Thread(target=long_stream), threading.Thread(target=openai_stream)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lines, server.log_tail()
    # Both streams in flight before the signal (a request that arrives after it is refused a connection).
    assert started.wait(60), server.log_tail()
    server.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert server.wait(60) == 0, server.log_tail()
    # Not cut off: an error event, then [DONE], then the response ends cleanly.
    assert outcome["raw"] == "complete"
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "shutting down" in lines[-2]
    # The official client raises the error event.
    assert "shutting down" in outcome["openai"]
    log = server.log_text()
    assert "Traceback" not in log and "leaked semaphore" not in log, log[-4000:]
    assert server.leftover_children() == []
