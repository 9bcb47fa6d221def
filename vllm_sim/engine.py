"""An asyncio engine that schedules requests the way vLLM's V1 scheduler does, in scaled time.

One background task runs engine *steps*. Each step first gives every running
sequence the KV slot its next token needs, preempting when the pool is full
(``_schedule_running``, vLLM's ``Scheduler.schedule``); then, if nobody was
preempted, admits waiting sequences in the queue's order (``vllm_sim.waiting``:
first-come or by priority, vLLM's ``--scheduling-policy``) while fewer than
``max_num_seqs`` run and their KV blocks fit (the waiting queue is unbounded,
like vLLM's); then it sleeps for the step's duration (prefill of the newly
admitted sequences' uncached tokens plus one decode step of the whole batch);
then every running sequence emits one token. So a request's time to first
token is its queueing plus one step whose length depends on its cache hit,
and its inter-token time grows with the batch it shares.

With a token budget (``TimingModel.max_num_batched_tokens``, vLLM's
--max-num-batched-tokens) a step schedules at most that many tokens, running
sequences first, in order (a decode takes one, a prompt being prefilled its
next chunk), then waiting ones while the budget lasts; the last admitted may
get only a chunk of its prompt, and its blocks are allocated and cached chunk
by chunk. A sequence emits a token only at the end of a step that completed
its prompt (or decoded), so a long prompt spans steps and the requests behind
it wait with seats free, as in vLLM. Without a budget every prompt is
prefilled whole in the step that admits it.

A preempted sequence loses its blocks (its hashed prompt blocks stay cached,
as a freed request's do) and goes back to the waiting queue; when it is
admitted again it recomputes its prompt and the tokens it already produced
(vLLM V1 preempts by recompute only), less what the prefix cache still holds,
and carries on where it stopped: the client sees a pause, not a repeat.

Each sequence that finishes is counted in vLLM's two prefill histograms: the
step it was admitted in (from its scheduling to its first token, as vLLM times
it, in scaled time) and its prompt tokens not served from the prefix cache.

Steps are timed against a running deadline rather than slept one by one,
because ``asyncio.sleep`` cannot sleep less than about a millisecond: at
``time_scale=0.01`` a 0.1 ms step would otherwise cost 1 ms. Overshoot is
repaid by skipping later sleeps, so throughput stays right over many steps.

A consumer that stops listening (client disconnect, cancellation) leaves the
``generate`` context: its sequences are dropped, their blocks released, and
an abort is counted, at once and not at the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from vllm_sim.kv import Allocation, KVPool, PoolEvent
from vllm_sim.reply import ReplyWriter, default_length, reply_seed
from vllm_sim.stats import EngineStats
from vllm_sim.timing import TimingModel
from vllm_sim.waiting import FCFSQueue, Policy, PriorityQueue, waiting_queue

__all__ = ["Engine", "GenRequest", "Generation", "RemoteLoad", "TokenEvent", "PromptTooLong"]

log = logging.getLogger("vllm_sim.engine")

# Stale KV (vllm_sim.pd) perturbs the reply's seed: another, wrong, answer.
_STALE_SEED = 0x5A5A5A5A

# Lag behind the step deadline forgiven at once (the loop was busy, not the GPU).
_MAX_LAG_S = 0.05

# The token budget of a step without --max-num-batched-tokens: every prompt whole.
_UNBOUNDED = 1 << 62


class PromptTooLong(ValueError):
    """The prompt needs more KV blocks than the whole pool has: it could never run."""


@dataclass(slots=True)
class RemoteLoad:
    """A decode request whose prompt KV was pulled from a prefill replica (vllm_sim.pd).

    vLLM's scheduler takes the local prefix hit when it admits the request, and the
    connector loads the rest of the prompt (``get_num_new_matched_tokens``: prompt tokens
    minus the local hit), so nothing of the prompt is computed here. The simulator pulls
    on arrival: local blocks evicted between arrival and admission are pulled then, as
    vLLM would have pulled them (``late``), not computed."""

    # Prompt tokens the replica held itself when the request arrived (not pulled).
    local_tokens: int
    # The prefill's own cache hit, ``remote_prefill_cached_tokens`` in the params: vLLM
    # reports it as the decode's cached_tokens (OutputProcessor) instead of its own.
    cached_report: int | None = None
    # Told the tokens pulled at admission (local blocks evicted since arrival).
    late: Callable[[int], None] | None = None


@dataclass(slots=True)
class GenRequest:
    request_id: str
    prompt_tokens: list[int]
    # None: the reply has its prompt-derived default length and ends with "stop".
    max_tokens: int | None = None
    n: int = 1
    cache_salt: str | None = None
    # Wall-clock seconds the request is held before it joins the queue (the
    # stall_before_first_token fault): it counts as waiting and aborts like one.
    hold_s: float = 0.0
    # The LoRA adapter the request names, as (name, path): it goes into every block's hash.
    lora: tuple[str, str] | None = None
    # vLLM's request priority: lower is served first under --scheduling-policy priority
    # (ignored under fcfs, as vLLM ignores it).
    priority: int = 0
    # P/D, prefill side: keep the blocks when the request finishes (vLLM's NIXL
    # request_finished delays their free until a decode pulls them); see Generation.held.
    hold_blocks: bool = False
    # P/D, decode side: the prompt's KV came from a prefill replica.
    remote: RemoteLoad | None = None
    # P/D: the pulled blocks had been freed on the prefill replica (lease expired): vLLM
    # reads them anyway and decodes from stale KV, so the reply differs from the right one.
    stale_kv: bool = False


@dataclass(slots=True)
class TokenEvent:
    index: int  # choice index
    text: str
    finish_reason: str | None  # set on the choice's last token


class _Seq:
    """One choice of a request as the scheduler sees it."""

    __slots__ = ("gen", "index", "writer", "target", "produced", "allocation", "computed", "prefill_s",
                 "sort_key", "preemptions", "kv_tokens", "step_tokens", "decoding")

    def __init__(self, gen: Generation, index: int, target: int, seed: int, arrival: int) -> None:
        self.gen = gen
        self.index = index
        # Its place in a priority queue: vLLM's Request.__lt__ order, (priority, arrival).
        self.sort_key = (gen.request.priority, arrival, index)
        self.preemptions = 0
        self.writer = ReplyWriter(seed)
        self.target = target
        self.produced = 0
        self.allocation: Allocation | None = None
        # Prompt tokens its prefill computes (not served from the prefix cache), and the
        # scaled seconds from its scheduling to its first token: vLLM's two prefill histograms.
        self.computed = 0
        self.prefill_s = 0.0
        # vLLM's num_computed_tokens (its KV, once this step ends); the tokens this step
        # schedules for it (0: not scheduled, the budget spent before its turn); and whether it
        # has emitted a token since it was last admitted (its next step is a decode).
        self.kv_tokens = 0
        self.step_tokens = 0
        self.decoding = False

    @property
    def total(self) -> int:
        """The tokens its KV must hold before its next token: the prompt and what it produced."""
        return self.gen.prompt_tokens + self.produced


class Generation:
    """A request in the engine; iterate it for its tokens as they are produced."""

    def __init__(self, request: GenRequest, hashes: list[bytes]) -> None:
        self.request = request
        self.hashes = hashes
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reasons: list[str | None] = [None] * request.n
        self.aborted = False
        # With ``hold_blocks``: each finished choice's blocks, still pinned, for the P/D
        # layer to take; ``Engine.generate`` releases any left when the request ends.
        self.held: list[Allocation] = []
        self._open = request.n
        self._events: list[TokenEvent] = []
        self._wake = asyncio.Event()

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def finished(self) -> bool:
        return self._open == 0

    def _push(self, event: TokenEvent) -> None:
        self._events.append(event)
        self.completion_tokens += 1
        if event.finish_reason is not None:
            self.finish_reasons[event.index] = event.finish_reason
            self._open -= 1
        self._wake.set()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            if self._events:
                batch, self._events = self._events, []
                for event in batch:
                    yield event
                continue
            if self._open == 0 or self.aborted:
                return
            self._wake.clear()
            await self._wake.wait()


class Engine:
    """Continuous batching over a ``KVPool`` with a ``TimingModel``; one per simulated replica."""

    def __init__(self, pool: KVPool, timing: TimingModel, stats: EngineStats | None = None,
                 policy: Policy = "fcfs") -> None:
        self.pool = pool
        self.timing = timing
        self.stats = stats if stats is not None else EngineStats()
        self.policy = policy
        self._waiting: FCFSQueue[_Seq] | PriorityQueue[_Seq] = waiting_queue(policy)
        self._arrivals = itertools.count()
        self._held: dict[Generation, tuple[asyncio.TimerHandle, list[_Seq]]] = {}
        self._running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._reported = (0, 0)  # (running, waiting) at the last step's end: ``reported``
        self._task: asyncio.Task[None] | None = None
        self._deadline = 0.0
        # Called after each step with what the pool cached and evicted in it (KV events),
        # as vLLM's scheduler hands its events to the publisher once per step.
        self.on_kv_events: Callable[[list[PoolEvent]], None] | None = None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def reported(self) -> tuple[int, int]:
        """(running, waiting) as vLLM's ``/metrics`` shows them: as of the end of the last step.

        vLLM's gauges are set from the scheduler's stats once per step, after the step's
        outputs (``Scheduler.make_stats`` in ``update_from_output``): the running requests
        that did not finish in it, and the waiting ones its ``schedule`` left waiting. A
        request that arrives during a step joins the scheduler only at the next one, so it
        shows as waiting beside free seats only when a step's token budget ran out before it
        (a prompt being chunked). Gateways read a queue beside a full batch as the replica's
        seat count (gateway.proxy.pool), so the instantaneous count would mislead them where
        vLLM does not."""
        return self._reported

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + sum(len(seqs) for _, seqs in self._held.values())

    @asynccontextmanager
    async def generate(self, request: GenRequest) -> AsyncIterator[Generation]:
        """Submit ``request``; leaving the block before it finishes aborts it."""
        gen = self._submit(request)
        try:
            yield gen
        finally:
            if not gen.finished and not gen.aborted:
                self._abort(gen)
            for allocation in gen.held:
                self.pool.release(allocation)
            gen.held = []

    async def aclose(self) -> None:
        """Stop the step task (app shutdown); requests still in flight are aborted."""
        for gen in {s.gen for s in [*self._running, *self._waiting]} | set(self._held):
            if not gen.aborted:
                self._abort(gen)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # -- submission and abort ----------------------------------------------------------------
    def check_prompt(self, num_tokens: int) -> None:
        """Raise ``PromptTooLong`` if a prompt this long could never be admitted."""
        if self.pool.blocks_for(num_tokens) > self.pool.num_blocks:
            raise PromptTooLong(
                f"The prompt has {num_tokens} tokens, more than the KV cache of this replica holds "
                f"({self.pool.num_blocks} blocks of {self.pool.block_size})."
            )

    def _submit(self, request: GenRequest) -> Generation:
        if request.n < 1:
            raise ValueError("n must be >= 1")
        self.check_prompt(len(request.prompt_tokens))
        hashes = self.pool.hash_prompt(request.prompt_tokens, request.cache_salt, request.lora)
        gen = Generation(request, hashes)
        seqs = []
        arrival = next(self._arrivals)
        for index in range(request.n):
            seed = reply_seed(request.prompt_tokens, index)
            if request.stale_kv:
                seed ^= _STALE_SEED
            target = request.max_tokens if request.max_tokens is not None else default_length(seed)
            seqs.append(_Seq(gen, index, max(1, target), seed, arrival))
        self.stats.requests += 1
        if request.hold_s > 0:
            handle = asyncio.get_running_loop().call_later(request.hold_s, self._enqueue_held, gen)
            self._held[gen] = (handle, seqs)
        else:
            self._enqueue(seqs)
        return gen

    def _enqueue(self, seqs: list[_Seq]) -> None:
        for seq in seqs:
            self._waiting.add(seq)
        self._ensure_task()
        self._wake.set()

    def _enqueue_held(self, gen: Generation) -> None:
        _, seqs = self._held.pop(gen)
        self._enqueue(seqs)

    def _abort(self, gen: Generation) -> None:
        gen.aborted = True
        held = self._held.pop(gen, None)
        if held is not None:
            held[0].cancel()
        self._waiting.remove_where([s for s in self._waiting if s.gen is gen])
        kept = []
        for seq in self._running:
            if seq.gen is gen:
                self._free(seq)
            else:
                kept.append(seq)
        self._running = kept
        self.stats.record_abort(gen.request.request_id)
        gen._wake.set()

    def _free(self, seq: _Seq) -> None:
        if seq.allocation is not None:
            self.pool.release(seq.allocation)
            seq.allocation = None

    # -- the step loop ------------------------------------------------------------------------
    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm_sim-engine")
            self._task.add_done_callback(_log_crash)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
                self._deadline = loop.time()
            budget = self.timing.max_num_batched_tokens or _UNBOUNDED
            for seq in self._running:
                seq.step_tokens = 0
            budget, preempted = self._schedule_running(budget)
            # vLLM admits nobody in a step that preempted (the freed blocks go to the
            # running requests that needed them, not to newcomers).
            if not preempted:
                self._admit(budget)
            left_waiting = self.num_waiting
            scheduled = [seq for seq in self._running if seq.step_tokens]
            prefills = [seq for seq in scheduled if not seq.decoding]
            duration = 0.0
            if prefills:
                duration += self.timing.prefill_time(sum(self._prefill_tokens(seq) for seq in prefills))
            if len(prefills) < len(scheduled):
                duration += self.timing.decode_step_time(len(scheduled))
            # From its first scheduling to its first token, over every chunk: its prefill time.
            for seq in prefills:
                if not seq.preemptions:
                    seq.prefill_s += duration
            await self._sleep_until_step_end(loop, duration)
            self.publish_kv_events()
            self._emit_tokens()
            self._reported = (len(self._running), left_waiting)

    def publish_kv_events(self) -> None:
        """Hand the pool's cache changes to ``on_kv_events`` (blocks are computed once the step ends)."""
        if self.on_kv_events is not None:
            events = self.pool.take_events()
            if events:
                self.on_kv_events(events)

    def _schedule_running(self, budget: int) -> tuple[int, bool]:
        """Schedule each running sequence's next tokens, preempting when blocks run out.

        vLLM 0.33's ``Scheduler.schedule`` (its loop over ``self.running``, while the
        token budget lasts): a decode takes one token, a prompt being prefilled its next
        chunk. When ``allocate_slots`` fails it preempts, under ``priority``, the running
        request with the largest (priority, arrival), else the last one admitted, and tries
        again; a request that preempts itself stops there (under ``priority`` the ones after
        it are still served, as they are higher in priority, and a victim already scheduled
        gives its tokens back to the budget). Returns the budget left and whether anything
        was preempted.
        """
        preempted = False
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            gen = seq.gen
            allocation = seq.allocation
            step = min(seq.total - seq.kv_tokens, budget)
            # A resumed sequence's prompt blocks are cached as its chunks fill them.
            hashes = gen.hashes if seq.kv_tokens < gen.prompt_tokens else ()
            lora = gen.request.lora
            need = seq.kv_tokens + step - (allocation.num_tokens if allocation else 0)
            while allocation is not None and need > 0 and not self.pool.grow(
                    allocation, need, hashes, gen.request.prompt_tokens, gen.request.cache_salt,
                    lora[0] if lora else None):
                if len(self._running) == 1:
                    # Alone and still out of blocks: vLLM never gets here (it refuses at start-up
                    # a max_model_len its KV cache cannot hold); the simulator allows small pools,
                    # so the sequence runs on with its growth uncounted rather than preempting
                    # itself for ever.
                    break
                if self.policy == "priority":
                    # (priority, arrival) only: among equals (an n > 1 request's choices) max
                    # takes the first in running order, as vLLM's key does.
                    victim = max(self._running, key=lambda s: s.sort_key[:2])
                else:
                    victim = self._running[-1]
                victim_index = self._running.index(victim)
                del self._running[victim_index]
                if victim_index < i:
                    i -= 1
                budget += victim.step_tokens
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.allocation is None:  # it preempted itself
                if self.policy == "priority":
                    continue  # the next one now sits at i
                break
            seq.step_tokens = step
            seq.kv_tokens += step
            budget -= step
            i += 1
        return budget, preempted

    def _preempt(self, seq: _Seq) -> None:
        """vLLM's ``Scheduler._preempt_request``: free the blocks, back to the waiting queue, recompute."""
        self._free(seq)
        seq.kv_tokens = seq.step_tokens = 0
        seq.decoding = False
        seq.preemptions += 1
        self.stats.record_preemption(seq.gen.request.request_id)
        self._waiting.prepend(seq)

    def _admit(self, budget: int) -> None:
        """Move waiting sequences to running while seats, blocks and the token budget allow."""
        while self._waiting and budget > 0 and len(self._running) < self.timing.max_num_seqs:
            seq = self._waiting.peek()
            gen = seq.gen
            lora = gen.request.lora
            remote = gen.request.remote
            resumed = seq.preemptions > 0
            # A resumed sequence recomputes what it had produced too; those tokens have no hashes.
            total = seq.total
            # A prompt pulled from a prefill replica is held whole at once, and only its last
            # token is computed (the connector loads the rest).
            pulled = remote is not None and not resumed
            allocation = self.pool.allocate(gen.hashes, total, gen.request.prompt_tokens,
                                            gen.request.cache_salt, lora[0] if lora else None,
                                            count=not resumed, limit=None if pulled else budget)
            if allocation is None:
                break  # the head waits for blocks; nobody overtakes it (vLLM breaks here too)
            self._waiting.pop()
            seq.allocation = allocation
            self._running.append(seq)
            seq.kv_tokens = allocation.num_tokens
            seq.step_tokens = 1 if pulled else allocation.num_tokens - allocation.cached_tokens
            budget -= seq.step_tokens
            computed = total - allocation.cached_tokens
            cached = allocation.cached_tokens
            if remote is not None and pulled:
                # The rest of the prompt was pulled: none of it is computed. vLLM counts local
                # + pulled tokens as cached (PrefillStats), unless the prefill's own hit came
                # along in the params.
                evicted = max(0, remote.local_tokens - allocation.cached_tokens)
                if evicted and remote.late is not None:
                    remote.late(evicted)
                computed = 0
                cached = gen.prompt_tokens if remote.cached_report is None else remote.cached_report
            if resumed:
                # vLLM's prefill statistics keep the first scheduling, not the repeats.
                continue
            seq.computed = computed
            if seq.index == 0:
                gen.cached_tokens = cached
                self.stats.prompt_tokens += gen.prompt_tokens
                self.stats.record_cached(gen.request.request_id, cached)

    @staticmethod
    def _prefill_tokens(seq: _Seq) -> int:
        """The tokens a prefill step computes for ``seq``: none for a prompt pulled whole."""
        return 0 if seq.gen.request.remote is not None and not seq.preemptions else seq.step_tokens

    async def _sleep_until_step_end(self, loop: asyncio.AbstractEventLoop, duration: float) -> None:
        now = loop.time()
        if now - self._deadline > _MAX_LAG_S:
            self._deadline = now
        self._deadline += duration
        delay = self._deadline - now
        # sleep(0) still yields, so request handlers run between steps even at time_scale=0.
        await asyncio.sleep(delay if delay > 0 else 0)

    def _emit_tokens(self) -> None:
        still_running = []
        for seq in self._running:
            if not seq.step_tokens or seq.kv_tokens < seq.total:
                still_running.append(seq)  # not scheduled, or a chunk of its prompt still to come
                continue
            seq.decoding = True
            seq.produced += 1
            done = seq.produced >= seq.target
            reason = None
            if done:
                reason = "length" if seq.gen.request.max_tokens is not None else "stop"
            seq.gen._push(TokenEvent(seq.index, seq.writer.next_token(), reason))
            self.stats.generation_tokens += 1
            if done:
                if seq.gen.request.hold_blocks and seq.allocation is not None:
                    # Finished by stop or length (an abort frees at once, as in vLLM).
                    seq.gen.held.append(seq.allocation)
                    seq.allocation = None
                self._free(seq)
                self.stats.record_prefill(seq.prefill_s, seq.computed, seq.preemptions)
                if seq.gen.finished:
                    self.stats.record_finish(reason or "stop")
            else:
                still_running.append(seq)
        self._running = still_running


def _log_crash(task: asyncio.Task[None]) -> None:
    # A crashed step loop would hang every request silently; make it loud.
    if not task.cancelled() and task.exception() is not None:
        log.error("engine step loop crashed", exc_info=task.exception())
