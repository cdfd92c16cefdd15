"""AsyncEngine (kvtier.server.async_engine) driven with a fake engine: no model, no server.

The fake implements only what AsyncEngine calls (add_request, abort_request, step,
has_unfinished, max_model_len; `admin`, an EngineAdmin over it without tiers) and is
deterministic: request tokens are a function of the prompt, and a gated fake takes one step per
`permit()`, so a test knows exactly what each step emits.
Every wait has a timeout, so a broken engine thread fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest

from kvtier.engine.admin import EngineAdmin
from kvtier.identity import Tenancy
from kvtier.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvtier.sampling_params import SamplingParams
from kvtier.server.async_engine import AsyncEngine, EngineDeadError, EngineStepError, RequestSpec, RequestStream

TIMEOUT_S = 10.0
"""Upper bound on any single wait: reached only when the engine thread is broken."""

T = TypeVar("T")


def tokens_for(prompt: list[int], n: int) -> list[int]:
    """The tokens the fake generates for `prompt`: prompt[-1] + 1, + 2, ..."""
    return [prompt[-1] + k + 1 for k in range(n)]


class FakeEngine:
    """The EngineCore interface AsyncEngine uses, with no model. Each step appends the next
    token to every live request; a request ends ("length") at its max_tokens. Gated: a step
    waits for a `permit()` (and fails after TIMEOUT_S without one)."""

    max_model_len = 64
    tiers = None

    def __init__(self, gated: bool = False, fail_at_step: int | None = None, break_at_step: int | None = None) -> None:
        self.fail_at_step = fail_at_step
        """This step raises (a failed step: AsyncEngine aborts what is in flight and goes on)."""
        self.break_at_step = break_at_step
        """After this step `has_unfinished` raises (the engine thread dies)."""
        self.broken = False
        self.num_steps = 0
        self.live: dict[str, tuple[list[int], list[int], int]] = {}
        """request id -> (prompt, tokens so far, max_tokens)."""
        self.aborted: list[str] = []
        self.added: list[str] = []
        self.arrivals: dict[str | None, float | None] = {}
        self._permits = threading.Semaphore(0) if gated else None
        self.admin = EngineAdmin(self)  # tiers = None: what AsyncEngine asks of the tiers is a no-op

    def permit(self, num_steps: int = 1) -> None:
        assert self._permits is not None
        for _ in range(num_steps):
            self._permits.release()

    # ------------------------------------------------------------------ the engine interface
    @property
    def has_unfinished(self) -> bool:
        if self.broken:
            raise RuntimeError("injected: the engine's state is broken")
        return bool(self.live)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        prompt: str | None = None,
        arrival_time: float | None = None,
        tenancy: Tenancy | None = None,
        stream_text: bool = False,
        lora_request: object = None,
    ) -> str:
        assert lora_request is None  # this engine has no adapters
        self.arrivals[request_id] = arrival_time
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        assert request_id is not None
        if request_id in self.live:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = params.max_tokens if params is not None and params.max_tokens is not None else 16
        self.live[request_id] = (list(prompt_token_ids), [], max_tokens)
        self.added.append(request_id)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id not in self.live:
            return None
        self.aborted.append(request_id)
        out = self._output(request_id, "abort")
        del self.live[request_id]
        return out

    def step(self) -> list[RequestOutput]:
        if self._permits is not None and not self._permits.acquire(timeout=TIMEOUT_S):
            raise TimeoutError("the test gave no permit for a step")
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("injected step failure")
        outs = []
        for rid, (prompt, toks, max_tokens) in list(self.live.items()):
            toks.append(tokens_for(prompt, len(toks) + 1)[-1])
            done = len(toks) >= max_tokens
            outs.append(self._output(rid, "length" if done else None))
            if done:
                del self.live[rid]
        if self.num_steps == self.break_at_step:
            self.broken = True
        return outs

    def _output(self, rid: str, finish_reason: str | None) -> RequestOutput:
        prompt, toks, _ = self.live[rid]
        completion = CompletionOutput(0, "", list(toks), finish_reason=finish_reason)
        return RequestOutput(rid, None, list(prompt), [completion], finish_reason is not None, RequestMetrics(0.0))


def spec(rid: str, prompt: list[int], max_tokens: int) -> RequestSpec:
    return RequestSpec(rid, prompt, SamplingParams(max_tokens=max_tokens))


async def within(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, TIMEOUT_S)


async def read_all(stream: RequestStream) -> list[RequestOutput]:
    """Every output a stream yields until the finished one."""
    outs = []
    while not stream.finished:
        outs.append(await within(stream.next()))
    return outs


def run(test: Any, engine: FakeEngine) -> tuple[AsyncEngine, list[tuple[RequestOutput, list[float]]]]:
    """Run `test(async_engine)` on a fresh event loop with a started AsyncEngine over `engine`;
    shut the engine thread down afterwards. Returns the engine and its on_finished calls."""
    finished: list[tuple[RequestOutput, list[float]]] = []

    async def main() -> AsyncEngine:
        ae = AsyncEngine(engine, on_finished=lambda out, itl: finished.append((out, list(itl))))
        ae.start()
        try:
            await test(ae)
        finally:
            await asyncio.to_thread(ae.shutdown, TIMEOUT_S)
        return ae

    ae = asyncio.run(main())
    assert not ae.alive, "shutdown() left the engine thread running"
    return ae, finished


# ---------------------------------------------------------------------- tests
def test_one_request_streams_each_step_in_order_and_finishes() -> None:
    engine = FakeEngine(gated=True)
    prompt = [3, 4, 5]
    want = tokens_for(prompt, 4)

    async def test(ae: AsyncEngine) -> None:
        (stream,) = await within(ae.add([spec("a", prompt, 4)]))
        for k in range(1, 5):  # one step at a time: each output is exactly that step's
            engine.permit()
            out = await within(stream.next())
            assert out.request_id == "a" and out.prompt_token_ids == prompt
            assert out.outputs[0].token_ids == want[:k]
            assert out.finished == (k == 4) and stream.finished == (k == 4)
        assert out.outputs[0].finish_reason == "length"

    _, finished = run(test, engine)
    assert not engine.live and engine.num_steps == 4 and not engine.aborted
    assert [(out.request_id, out.outputs[0].token_ids) for out, _ in finished] == [("a", want)]
    assert len(finished[0][1]) == 3  # one inter-token interval per token after the first


def test_the_engine_gets_the_servers_arrival_time() -> None:
    """TTFT and queue time count from when the server took the request, not from when the
    engine thread got to it (after its current step), as vLLM counts from its API server."""
    engine = FakeEngine()
    taken = spec("a", [1, 2], 2)

    async def test(ae: AsyncEngine) -> None:
        (stream,) = await within(ae.add([taken]))
        await read_all(stream)

    run(test, engine)
    assert engine.arrivals == {"a": taken.arrival_time}


def test_concurrent_requests_each_get_their_own_tokens() -> None:
    engine = FakeEngine()
    prompts = {"a": ([10], 3), "b": ([20, 21], 7), "c": ([30], 1), "d": ([40], 5)}

    async def test(ae: AsyncEngine) -> None:
        # two adds racing each other, then reads of every stream at once
        first, second = await within(
            asyncio.gather(
                ae.add([spec(r, p, n) for r, (p, n) in list(prompts.items())[:2]]),
                ae.add([spec(r, p, n) for r, (p, n) in list(prompts.items())[2:]]),
            )
        )
        streams = first + second
        results = await within(asyncio.gather(*(read_all(s) for s in streams)))
        for stream, outs in zip(streams, results):
            prompt, n = prompts[stream.request_id]
            assert all(o.request_id == stream.request_id for o in outs)
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            assert lengths == sorted(set(lengths)), "outputs went backwards or repeated"
            assert outs[-1].finished and outs[-1].outputs[0].token_ids == tokens_for(prompt, n)

    _, finished = run(test, engine)
    assert sorted(out.request_id for out, _ in finished) == sorted(prompts)
    assert not engine.live and not engine.aborted


def test_abort_of_a_running_request_ends_its_stream_and_frees_it() -> None:
    engine = FakeEngine(gated=True)

    async def test(ae: AsyncEngine) -> None:
        (stream,) = await within(ae.add([spec("a", [7], 1000)]))
        engine.permit()
        assert (await within(stream.next())).outputs[0].token_ids == [8]
        ae.abort("a")  # the engine thread is inside step 2: the abort is handled right after it
        ae.abort("nobody")  # an unknown id is ignored
        engine.permit()
        outs = await read_all(stream)
        last = outs[-1].outputs[0]
        assert last.finish_reason == "abort" and last.token_ids == [8, 9]
        # the engine is idle again: an idle call runs
        assert await within(ae.run_when_idle(lambda core: core.has_unfinished)) is False

    _, finished = run(test, engine)
    assert engine.aborted == ["a"] and not engine.live and engine.num_steps == 2
    assert [out.outputs[0].finish_reason for out, _ in finished] == ["abort"]


def test_bad_input_raises_to_the_caller_and_adds_nothing() -> None:
    engine = FakeEngine()

    async def test(ae: AsyncEngine) -> None:
        with pytest.raises(ValueError, match="prompt is empty"):
            await within(ae.add([spec("ok", [1], 2), spec("bad", [], 2)]))
        (stream,) = await within(ae.add([spec("ok2", [1], 2)]))
        assert (await read_all(stream))[-1].outputs[0].token_ids == [2, 3]

    run(test, engine)
    assert engine.added == ["ok", "ok2"] and engine.aborted == ["ok"]  # all or none


def test_a_failed_step_reaches_every_waiting_stream_and_the_engine_goes_on() -> None:
    engine = FakeEngine(fail_at_step=3)

    async def test(ae: AsyncEngine) -> None:
        streams = await within(ae.add([spec("a", [1], 1000), spec("b", [2], 1000)]))
        for stream in streams:
            with pytest.raises(EngineStepError, match="injected step failure"):
                await read_all(stream)
            assert stream.finished
        assert ae.alive
        (stream,) = await within(ae.add([spec("c", [5], 2)]))
        assert (await read_all(stream))[-1].outputs[0].token_ids == [6, 7]

    _, finished = run(test, engine)
    assert sorted(engine.aborted) == ["a", "b"] and not engine.live
    assert [out.request_id for out, _ in finished] == ["c"]


def test_a_dead_engine_thread_fails_every_waiting_caller() -> None:
    engine = FakeEngine(gated=True, break_at_step=2)

    async def test(ae: AsyncEngine) -> None:
        (stream,) = await within(ae.add([spec("a", [1], 1000)]))
        # the engine thread waits inside step 1; queue an idle call and a call between steps
        idle = asyncio.ensure_future(ae.run_when_idle(lambda core: "never"))
        soon = asyncio.ensure_future(ae.run_soon(lambda core: "between steps"))
        await asyncio.sleep(0)  # both reach the inbox
        engine.permit()  # step 1; then the thread takes both calls: the idle one waits for idle
        assert await within(soon) == "between steps"
        engine.permit()  # step 2, after which the engine's state breaks: the thread dies
        with pytest.raises(EngineDeadError, match="died"):
            await read_all(stream)
        with pytest.raises(EngineDeadError, match="died"):
            await within(idle)
        thread = ae._thread
        assert thread is not None
        await within(asyncio.to_thread(thread.join, TIMEOUT_S))
        assert not ae.alive and isinstance(ae.error, RuntimeError)
        with pytest.raises(EngineDeadError, match="not running"):
            await within(ae.add([spec("b", [1], 2)]))
        with pytest.raises(EngineDeadError, match="not running"):
            await within(ae.run_soon(lambda core: None))

    run(test, engine)
    assert engine.aborted == ["a"]


def test_shutdown_ends_streams_and_idle_calls_in_flight() -> None:
    engine = FakeEngine(gated=True)

    async def test(ae: AsyncEngine) -> None:
        (stream,) = await within(ae.add([spec("a", [1], 1000)]))
        engine.permit()
        await within(stream.next())
        idle = asyncio.ensure_future(ae.run_when_idle(lambda core: "never"))
        await asyncio.sleep(0)  # let the idle call reach the inbox (the thread waits inside step 2)
        ae.shutdown(timeout_s=0)  # queue the stop without waiting for it
        engine.permit()  # step 2 ends; the thread then reads the idle call and the stop
        with pytest.raises(EngineDeadError, match="shutting down"):
            await read_all(stream)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await within(idle)
        await within(asyncio.to_thread(ae.shutdown, TIMEOUT_S))
        assert not ae.alive
        with pytest.raises(EngineDeadError):
            await within(ae.add([spec("b", [1], 2)]))

    run(test, engine)
    assert engine.aborted == ["a"] and engine.num_steps == 2


def test_shutdown_of_an_idle_engine_stops_the_thread() -> None:
    engine = FakeEngine()

    async def test(ae: AsyncEngine) -> None:
        assert ae.alive and ae.max_model_len == FakeEngine.max_model_len and not ae.has_tiers

    ae, finished = run(test, engine)
    assert ae.error is None and not finished and engine.num_steps == 0
