"""The sandbox process that renders chat templates sent in requests: the same text as rendering here,
and a template that allocates without bound, loops for minutes or names a file is stopped (a RequestError
naming the field) while this process stays small and the sandbox serves the next template."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace

import psutil
import pytest

from pagedllm.chat_template import ChatRender, prepare_chat_render
from pagedllm.entrypoints.openai.template_sandbox import MAX_RENDERED_CHARS, TemplateSandbox
from pagedllm.errors import RequestError

TIMEOUT_S = 2.0
TOKENIZER = SimpleNamespace(chat_template="{{ messages[0]['content'] }}", bos_token="<s>", eos_token="</s>")
MESSAGES = [{"role": "user", "content": "Hi"}]
# The 2000x2000 loop (a few seconds here, minutes on a slow server), and loops that never end.
NESTED_LOOPS = "{% for i in range(2000) %}{% for j in range(2000) %}{{ i }}{% endfor %}{% endfor %}"
ENDLESS_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def sandbox() -> Iterator[TemplateSandbox]:
    box = TemplateSandbox(timeout_s=TIMEOUT_S)
    box.start()
    try:
        yield box
    finally:
        box.close()


def _job(template: str, **options: object) -> ChatRender:
    return prepare_chat_render(TOKENIZER, MESSAGES, template, **options)  # type: ignore[arg-type]


def _render(sandbox: TemplateSandbox, template: str) -> str:
    return asyncio.run(sandbox.render(_job(template)))


def _refused(sandbox: TemplateSandbox, template: str) -> RequestError:
    with pytest.raises(RequestError) as info:
        _render(sandbox, template)
    return info.value


def test_renders_as_here(sandbox: TemplateSandbox) -> None:
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{{ extra }}"
    job = prepare_chat_render(TOKENIZER, MESSAGES, template, chat_template_kwargs={"extra": "!"})  # type: ignore[arg-type]
    assert asyncio.run(sandbox.render(job)) == job.render() == "<s>[user] Hi!"


def test_a_path_is_template_text(sandbox: TemplateSandbox) -> None:
    assert _render(sandbox, "/etc/passwd") == "/etc/passwd"
    error = _refused(sandbox, "{% include '/etc/passwd' %}")  # the environment has no loader
    assert "root:" not in error.message


def test_huge_output_and_allocations_are_refused_and_this_process_stays_small(sandbox: TemplateSandbox) -> None:
    _render(sandbox, "ready")
    rss = psutil.Process().memory_info().rss
    error = _refused(sandbox, "{{ 'x' * 9000000 }}")
    assert error.param == "chat_template" and f"more than the limit of {MAX_RENDERED_CHARS}" in error.message
    for template in (
        "{{'x'*200000000}}",  # the 70-byte template that OOM-killed a server (time or size stop it here)
        "{{'x'*5000000000}}",
        "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
    ):
        _render(sandbox, "ready")  # after a kill, a fresh process gets ready first (its imports)
        start = time.monotonic()
        error = _refused(sandbox, template)
        assert error.param == "chat_template" and time.monotonic() - start < TIMEOUT_S + 2, error.message
    assert psutil.Process().memory_info().rss - rss < 100 * 2**20
    assert _render(sandbox, "ok") == "ok"


@pytest.mark.parametrize("template", [NESTED_LOOPS, ENDLESS_LOOPS], ids=["2000x2000", "endless"])
def test_a_long_render_stops_at_the_time_bound(sandbox: TemplateSandbox, template: str) -> None:
    _render(sandbox, "ready")  # a fresh process after a kill gets ready first (its imports)
    start = time.monotonic()
    error = _refused(sandbox, template)
    assert error.param == "chat_template"
    assert time.monotonic() - start < TIMEOUT_S + 2
    if template == ENDLESS_LOOPS:
        assert f"longer than {TIMEOUT_S:g} s" in error.message
    assert _render(sandbox, "{{ messages[0].content }}") == "Hi"  # the next template is served


def test_errors_name_the_field_at_fault(sandbox: TemplateSandbox) -> None:
    assert _refused(sandbox, "{% for %}").param == "chat_template"
    error = _refused(sandbox, "{{ ().__class__.__base__.__subclasses__() }}")
    assert error.param == "chat_template" and "sandbox" in error.message
    assert _refused(sandbox, "{{ raise_exception('roles must alternate') }}").param == "messages"
    assert _refused(sandbox, "{{ 1 / 0 }}").param == "chat_template"


def test_chat_template_kwargs_cannot_replace_the_template() -> None:
    with pytest.raises(RequestError) as info:
        _job("{{ 1 }}", chat_template_kwargs={"chat_template": "{{ 2 }}"})
    assert info.value.param == "chat_template_kwargs"
