"""Chat templates cannot stall or bloat `kvtier serve` (issue 33): a request's `chat_template`
is refused unless the server runs with --trust-request-chat-template; with it, renders are
bounded in size, `range` work and time (kvtier.model.tokenizer.RenderLimits), each overrun a
400 naming `chat_template`; `chat_template_kwargs` cannot replace the template's variables."""

from __future__ import annotations

import itertools

import httpx
import pytest
from jinja2 import TemplateError

from kvtier.model.tokenizer import RenderLimits, Tokenizer, TokenizerError, build_byte_tokenizer

MESSAGES = [{"role": "user", "content": "Hi"}]
NESTED_RANGE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE_STRING = "{{ ('x' * 1000000000)[:3] }}"
HUGE_POWER = "{{ ('x' * 10**10)[:3] }}"


@pytest.fixture(scope="module")
def default_server(serve):
    s = serve()
    yield s
    assert "Traceback" not in s.log(), s.log()


@pytest.fixture(scope="module")
def trusting_server(serve):
    s = serve("--trust-request-chat-template")
    yield s
    assert "Traceback" not in s.log(), s.log()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _chat(template: str | None = None, **extra) -> dict:
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, **extra}
    if template is not None:
        body["chat_template"] = template
    return body


def _tokenize(template: str | None = None, **extra) -> dict:
    body = {"messages": MESSAGES, **extra}
    if template is not None:
        body["chat_template"] = template
    return body


def _error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", _chat), ("/tokenize", _tokenize)])
def test_request_template_is_refused_by_default(default_server, path, body):
    message = _error(_post(default_server, path, body("{{ messages[0].content }}")), "chat_template")
    assert "--trust-request-chat-template" in message
    assert _post(default_server, path, body()).status_code == 200  # the model's template still serves


@pytest.mark.parametrize("template", [NESTED_RANGE, HUGE_STRING, HUGE_POWER])
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", _chat), ("/tokenize", _tokenize)])
def test_runaway_request_templates_are_a_400(trusting_server, path, body, template):
    message = _error(_post(trusting_server, path, body(template)), "chat_template")
    assert "the chat template" in message
    assert _post(trusting_server, path, body()).status_code == 200


def test_trusted_request_template_renders(trusting_server, llm_tokenizer):
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    r = _post(trusting_server, "/tokenize", _tokenize(template, add_generation_prompt=False))
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == llm_tokenizer.encode("[user]Hi", add_special_tokens=False)
    r = _post(trusting_server, "/v1/chat/completions", _chat(template))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("[user]Hi")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chat_template": "{{ 'smuggled' }}"},
        {"messages": [{"role": "system", "content": "injected"}]},
        {"add_generation_prompt": False},
        {"bos_token": "<evil>"},
        {"range": 5},
        {"raise_exception": None},
    ],
)
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", _chat), ("/tokenize", _tokenize)])
def test_chat_template_kwargs_cannot_override_the_template(default_server, path, body, kwargs):
    message = _error(_post(default_server, path, body(chat_template_kwargs=kwargs)), "chat_template_kwargs")
    assert next(iter(kwargs)) in message


def test_chat_template_kwargs_still_reach_the_template(trusting_server):
    r = _post(
        trusting_server,
        "/tokenize",
        _tokenize("{{ greeting }}", chat_template_kwargs={"greeting": "hello"}, add_generation_prompt=False),
    )
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len("hello")


# ------------------------------------------------------------------ the sandbox itself


@pytest.fixture(scope="module")
def llm_tokenizer(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("byte_tok")
    build_byte_tokenizer(d)
    return Tokenizer(d)


def _render(tok: Tokenizer, template: str | None, limits: RenderLimits, messages=MESSAGES) -> str:
    return tok.apply_chat_template(messages, False, chat_template=template, limits=limits)


def test_binops_refuse_results_over_the_size_cap(llm_tokenizer):
    limits = RenderLimits(max_chars=100)
    assert _render(llm_tokenizer, "{{ 'x' * 100 }}", limits) == "x" * 100
    for template in [
        "{{ 'x' * 101 }}",
        "{{ ['x'] * 101 }}",
        "{{ ['x' * 60] * 2 }}",
        "{{ 'x' * 60 + 'y' * 60 }}",
        "{{ 'x' * 60 ~ 'y' * 60 }}",
        "{{ 9 ** 1000 }}",
        "{{ 'x'|center(1000) }}",
        "{{ 'x'.ljust(1000) }}",
        "{{ '%1000000000d' % 1 }}",
        "{{ '{:>1000000000}'.format(1) }}",
    ]:
        with pytest.raises(TemplateError, match="the chat template"):
            _render(llm_tokenizer, template, limits)
    with pytest.raises(TemplateError, match="the chat template built a value"):
        _render(llm_tokenizer, HUGE_STRING, RenderLimits())


def test_range_budget_counts_nested_loops_together(llm_tokenizer):
    template = "{% for i in range(10) %}{% for j in range(10) %}.{% endfor %}{% endfor %}"
    assert _render(llm_tokenizer, template, RenderLimits(max_range_items=110)) == "." * 100  # 10 + 10 * 10
    with pytest.raises(TemplateError, match=r"range\(\) over 109 items"):
        _render(llm_tokenizer, template, RenderLimits(max_range_items=109))


def test_rendered_output_is_capped(llm_tokenizer):
    long = [{"role": "user", "content": "y" * 200}]
    with pytest.raises(TemplateError, match="built a text over 100"):
        _render(llm_tokenizer, None, RenderLimits(max_chars=100), messages=long)  # the model's own template


def test_deadline_interrupts_a_loop_without_calls(llm_tokenizer):
    """A request template's loop that calls nothing is stopped by the line tracer; the clock
    is a counter, so the deadline is reached after a known number of readings."""
    ticks = itertools.count()
    limits = RenderLimits(timeout_s=1000, clock=lambda: next(ticks))
    many = MESSAGES * 100
    template = "{% for a in messages %}{% for b in messages %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateError, match="ran past its 1000 s limit"):
        _render(llm_tokenizer, template, limits, messages=many)
    assert _render(llm_tokenizer, template, RenderLimits(timeout_s=1000, clock=lambda: 0.0), messages=many) == ""


def test_deadline_applies_to_the_models_template(llm_tokenizer):
    ticks = itertools.count()
    many = MESSAGES * 100
    with pytest.raises(TemplateError, match="ran past"):
        _render(llm_tokenizer, None, RenderLimits(timeout_s=20, clock=lambda: next(ticks)), messages=many)
    assert _render(llm_tokenizer, None, RenderLimits(), messages=many).count("Hi") == 100


def test_template_faults_are_template_errors(llm_tokenizer):
    for template in [
        "{{ 1 / 0 }}",
        "{{ 10.0 ** 1000 }}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "{{" + "(" * 5000 + "1" + ")" * 5000 + "}}",  # nesting too deep to compile
    ]:
        with pytest.raises(TemplateError):
            _render(llm_tokenizer, template, RenderLimits())
    with pytest.raises(TemplateError):
        _render(llm_tokenizer, "{{ lipsum(1000000000) }}", RenderLimits())  # no lipsum: undefined


def test_kwargs_cannot_set_render_variables(llm_tokenizer):
    for name in ["bos_token", "raise_exception", "range"]:
        with pytest.raises(TokenizerError, match=name):
            llm_tokenizer.apply_chat_template(MESSAGES, **{name: "x"})


@pytest.fixture(scope="module")
def template_procs():
    from kvtier.server.template_procs import TemplateProcesses

    procs = TemplateProcesses(workers=1)
    yield procs
    procs.close()


def _proc_render(procs, template: str, messages=MESSAGES, **kw):
    return procs.render(template, "<s>", "</s>", messages, True, None, False, kw)


def test_request_templates_render_in_a_worker_process_as_in_the_server(tmp_path, template_procs) -> None:
    """--trust-request-chat-template renders in a spawned worker (no GIL shared with the
    event loop or the engine): the same text as the in-thread render, and the same errors."""
    build_byte_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ extra }}"
    got = _proc_render(template_procs, template, extra="!")
    assert got == "<s>[user]Hi!"
    tok.bos_token = "<s>"
    assert tok.apply_chat_template(MESSAGES, True, chat_template=template, extra="!") == got
    with pytest.raises(TemplateError, match="range"):
        _proc_render(template_procs, "{% for i in range(10**8) %}{% endfor %}")
    with pytest.raises(TemplateError, match="ZeroDivisionError"):
        _proc_render(template_procs, "{{ 1 / 0 }}")
    with pytest.raises(TokenizerError, match="continue_final_message"):
        template_procs.render(template, "<s>", "</s>", MESSAGES, True, None, True, {})
    assert _proc_render(template_procs, "ok {{ messages | length }}") == "ok 1"  # the worker lives on


def test_a_request_template_loop_ends_at_its_deadline_in_the_worker(template_procs) -> None:
    with pytest.raises(TemplateError, match=r"limit|over"):
        _proc_render(template_procs, NESTED_RANGE)
    assert _proc_render(template_procs, "fine") == "fine"
