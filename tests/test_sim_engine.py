"""The simulator's engine in-process: batching, timing, cache hits, aborts, speed."""

from __future__ import annotations

import asyncio
import time

import pytest

from vllm_sim.engine import Engine, GenRequest, PromptTooLong
from vllm_sim.kv import KVPool
from vllm_sim.timing import TimingModel
from vllm_sim.tokenizer import tokenize

pytestmark = pytest.mark.anyio


def _engine(blocks: int = 1024, **timing: float) -> Engine:
    return Engine(KVPool(blocks), TimingModel(**timing))


async def _run(engine: Engine, request: GenRequest) -> tuple[list[str], float]:
    """All token texts and the time to the first one."""
    start = time.perf_counter()
    first = None
    texts = []
    async with engine.generate(request) as gen:
        async for ev in gen:
            first = first if first is not None else time.perf_counter() - start
            texts.append(ev.text)
    return texts, first or 0.0


async def test_generates_deterministic_reply_of_requested_length() -> None:
    engine = _engine(time_scale=0)
    prompt = tokenize("tell me about prefix caching")
    a, _ = await _run(engine, GenRequest("a", prompt, max_tokens=7))
    b, _ = await _run(engine, GenRequest("b", prompt, max_tokens=7))
    assert a == b and len(a) == 7
    async with engine.generate(GenRequest("c", prompt)) as gen:
        events = [ev async for ev in gen]
    assert 16 <= len(events) <= 64 and events[-1].finish_reason == "stop"
    assert all(ev.finish_reason is None for ev in events[:-1])
    assert gen.finish_reasons == ["stop"] and gen.completion_tokens == len(events)
    assert engine.stats.completed == 3 and engine.pool.usage == 0
    await engine.aclose()


async def test_n_choices_share_the_prompt_blocks() -> None:
    engine = _engine(time_scale=0)
    prompt = tokenize("shared " * 100)
    async with engine.generate(GenRequest("n", prompt, max_tokens=4, n=3)) as gen:
        events = [ev async for ev in gen]
    assert sorted(ev.index for ev in events) == [0] * 4 + [1] * 4 + [2] * 4
    assert gen.finish_reasons == ["length"] * 3
    texts = ["".join(ev.text for ev in events if ev.index == i) for i in range(3)]
    assert len(set(texts)) == 3
    # Choices 1 and 2 are admitted after choice 0 registered the prompt's blocks.
    assert engine.pool.hits_tokens == 2 * ((len(prompt) - 1) // 16) * 16
    await engine.aclose()


async def test_max_num_seqs_caps_running_and_the_rest_wait() -> None:
    engine = _engine(max_num_seqs=2, time_scale=1.0, decode_base_s=0.01, prefill_base_s=0.0)
    tasks = [asyncio.create_task(_run(engine, GenRequest(f"r{i}", tokenize(f"q{i}"), max_tokens=5)))
             for i in range(5)]
    await asyncio.sleep(0.02)
    assert engine.num_running == 2 and engine.num_waiting == 3
    await asyncio.gather(*tasks)
    assert engine.num_running == 0 and engine.stats.completed == 5
    await engine.aclose()


async def test_metrics_show_the_last_steps_figures_as_vllm_does() -> None:
    # vLLM sets its running and waiting gauges from the scheduler once per step: a request that
    # arrives during a step, with seats free, is running by the next figures, never waiting.
    engine = _engine(max_num_seqs=4, time_scale=1.0, decode_base_s=0.02, prefill_base_s=0.0)
    # Answers long enough that nothing here finishes, however slow the machine (the tasks are
    # cancelled at the end).
    first = asyncio.create_task(_run(engine, GenRequest("a", tokenize("first"), max_tokens=5000)))
    await asyncio.sleep(0.03)  # in the middle of a decode step
    second = asyncio.create_task(_run(engine, GenRequest("b", tokenize("second"), max_tokens=5000)))
    await asyncio.sleep(0)
    assert engine.num_waiting == 1  # it has not been scheduled yet ...
    assert engine.reported == (1, 0)  # ... and the figures are the last step's
    for _ in range(20):
        await asyncio.sleep(0.01)
        assert engine.reported[1] == 0  # a seat was free at every step: nobody waited
    assert engine.reported[0] == 2
    # Past max_num_seqs the figures show the queue, once a step has left it waiting.
    more = [asyncio.create_task(_run(engine, GenRequest(f"c{i}", tokenize(f"q{i}"), max_tokens=5000)))
            for i in range(4)]
    await asyncio.sleep(0.05)
    assert engine.reported == (4, 2)
    for task in (first, second, *more):
        task.cancel()
    await asyncio.gather(first, second, *more, return_exceptions=True)
    await engine.aclose()


async def test_cache_hit_shortens_time_to_first_token() -> None:
    engine = _engine(prefill_base_s=0.0, prefill_s_per_token=0.0001, decode_base_s=0.001)
    prompt = tokenize("word " * 1500)  # 1,500 tokens: 150 ms of prefill cold
    _, cold = await _run(engine, GenRequest("cold", prompt, max_tokens=1))
    _, warm = await _run(engine, GenRequest("warm", prompt, max_tokens=1))
    assert cold >= 0.14
    assert warm < cold / 4
    assert engine.stats.cached_tokens == {"cold": 0, "warm": 1488}
    await engine.aclose()


async def test_small_time_scales_keep_their_throughput_despite_coarse_sleeps() -> None:
    # 300 steps of 0.1 ms: naive per-step sleeps would take ~300 ms (1 ms floor each).
    engine = _engine(time_scale=0.01, decode_base_s=0.01, decode_s_per_seq=0.0, prefill_base_s=0.0)
    start = time.perf_counter()
    texts, _ = await _run(engine, GenRequest("t", tokenize("x"), max_tokens=300))
    elapsed = time.perf_counter() - start
    assert len(texts) == 300
    assert 0.029 <= elapsed < 0.15
    await engine.aclose()


async def test_cancelled_consumer_aborts_at_once_and_frees_blocks() -> None:
    engine = _engine(time_scale=1.0, decode_base_s=0.05)
    prompt = tokenize("abort me " * 40)

    async def consume() -> None:
        async with engine.generate(GenRequest("gone", prompt, max_tokens=100)) as gen:
            async for _ in gen:
                pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.12)
    assert engine.num_running == 1 and engine.pool.usage > 0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert engine.num_running == 0 and engine.pool.usage == 0
    assert engine.stats.aborted == 1 and engine.stats.aborts[0][0] == "gone"
    assert engine.pool.num_cached_blocks == len(prompt) // 16
    await engine.aclose()


async def test_abort_while_waiting_removes_it_from_the_queue() -> None:
    engine = _engine(max_num_seqs=1, time_scale=1.0, decode_base_s=0.05)
    first = asyncio.create_task(_run(engine, GenRequest("first", [1, 2, 3], max_tokens=3)))
    await asyncio.sleep(0)
    second = asyncio.create_task(_run(engine, GenRequest("second", [4, 5, 6], max_tokens=3)))
    await asyncio.sleep(0.01)
    assert engine.num_waiting == 1
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    assert engine.num_waiting == 0 and engine.stats.aborted == 1
    await first
    await engine.aclose()


async def test_fcfs_head_waits_for_blocks_and_too_long_prompts_are_refused() -> None:
    engine = _engine(blocks=8, time_scale=1.0, decode_base_s=0.02)
    with pytest.raises(PromptTooLong):
        async with engine.generate(GenRequest("huge", list(range(9 * 16)), max_tokens=1)):
            pass
    big = asyncio.create_task(_run(engine, GenRequest("big", list(range(6 * 16)), max_tokens=3)))
    await asyncio.sleep(0.005)
    later_prompt = list(range(1000, 1000 + 5 * 16))
    later = asyncio.create_task(_run(engine, GenRequest("later", later_prompt, max_tokens=1)))
    await asyncio.sleep(0.005)
    assert engine.num_running == 1 and engine.num_waiting == 1
    await asyncio.gather(big, later)
    assert engine.stats.completed == 2
    await engine.aclose()


async def test_time_scale_zero_pushes_a_thousand_requests_fast() -> None:
    engine = _engine(blocks=8192, time_scale=0)
    start = time.perf_counter()
    results = await asyncio.gather(
        *(_run(engine, GenRequest(f"r{i}", tokenize(f"system prompt. question {i}"), max_tokens=8))
          for i in range(1000))
    )
    assert all(len(texts) == 8 for texts, _ in results)
    assert time.perf_counter() - start < 5.0
    assert engine.stats.completed == 1000 and engine.num_running == 0
    await engine.aclose()


async def test_held_request_waits_then_runs_and_aborts_like_a_waiting_one() -> None:
    engine = _engine(time_scale=0)
    start = time.perf_counter()
    texts, first = await _run(engine, GenRequest("held", [1, 2, 3], max_tokens=2, hold_s=0.1))
    assert len(texts) == 2 and first >= 0.1
    task = asyncio.create_task(_run(engine, GenRequest("gone", [1, 2, 3], max_tokens=2, hold_s=5)))
    await asyncio.sleep(0.02)
    assert engine.num_waiting == 1 and engine.num_running == 0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert engine.num_waiting == 0 and engine.stats.aborted == 1 and engine.stats.completed == 1
    assert time.perf_counter() - start < 1.0
    await engine.aclose()
