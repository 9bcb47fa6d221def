"""Disaggregated prefill and decode (P/D): the router's three steps, as vLLM 0.33 speaks them.

A fleet with replicas of role ``prefill`` and ``decode`` (``ReplicaSettings.role``;
both sides run vLLM's NixlConnector with ``kv_role: kv_both``) serves a request in
up to three steps, each a leg through ``upstream.open_upstream``:

1. to a prefill replica, chosen by the routing policy among the prefill replicas
   (where the prefix is warm): the request with ``kv_transfer_params`` asking for a
   remote decode (``REMOTE_DECODE``), no streaming, one output token (the API's
   ``LegShape``), the tenant's ``cache_salt`` as on every request. Its answer is
   read whole and closed, its slot and lease given back, before anything else;
2. the ``kv_transfer_params`` it returns (vLLM's ``NixlConnectorScheduler.
   request_finished``: engine id, block ids, host, port, ...) are taken as they are;
3. the original request, with those params spliced in, goes to a decode replica
   (routing's pick among the decode-capable ones: ``decode`` and ``both``), which
   pulls the blocks and streams; the relay is the one every request has.

Whether step 1 runs at all is decided per request (``routing.disagg.decide``):
a request whose decode replica already holds most of its prompt is prefilled
there (``local``), as llm-d's prefix-based decider does. The two learned terms
the decision needs beside routing's prefill rates live here (``Learned``).

Faults: a prefill leg that fails (5xx, garbage) is retried once on another
prefill replica, then falls back to a local prefill; one that times out, is
refused (4xx) or answers without params falls back at once (another would most
likely do the same, and the wait is spent); a decode replica that fails before
its first byte with a prefill replica's params (5xx: vLLM's answer to a failed
pull) prefills locally, on the same replica and outside the retry budget
(``Disagg._recompute`` says why); one that fails otherwise, or fails that too, is
replaced by another decode replica, prefilled again on another prefill replica,
within the pool's retry budget, unless it is gone (it dropped the connection and
refused a new one: ``upstream.take_retry``, once per request). A streamed decode
leg fails "before its first byte" until its first event is in hand, after its
headers too (``upstream.UpstreamCall.first``). A decode leg that sends no answer,
or no first event, in time is the client's 504, not retried (the replica may be
working on it), and a failed leg. Once the client has seen a byte, nothing is
retried (the relay's rules).
When no replica has a P/D role none of this runs: the endpoint's only cost is a
scan of the replicas' roles (``ReplicaPool.disaggregated``).

Both learned terms, and ``both`` replicas never taking prefill legs (the role
says they serve whole requests, and they may run no KV connector), are in
docs/disaggregation.md.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

import orjson

from routing import RouteFeedback, RouteRequest, RoutingPolicy, load_now
from routing.backlog import CHARS_PER_TOKEN
from routing.disagg import Decision, Terms, decide

from gateway.errors import GatewayError, NoReplica, UpstreamError, UpstreamTimeout
from .relay import read_whole
from .sse import Usage
from .upstream import Attempt, SentAndDropped, TimedOut, UpstreamCall, open_upstream, read_error_body, take_retry

if TYPE_CHECKING:
    from .context import RequestContext
    from .pool import Replica
    from gateway.runtime import Runtime

__all__ = ["CHAT_LEG", "COMPLETIONS_LEG", "DECODE_ROLES", "PREFILL_ROLES", "REMOTE_DECODE", "Disagg", "LegShape",
           "with_params"]

log = logging.getLogger("kvgate.disagg")

# What the prefill leg asks of the prefill replica, exactly as vLLM's toy proxy
# (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) sends it.
REMOTE_DECODE: Mapping[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                    "remote_block_ids": None, "remote_host": None, "remote_port": None}
PREFILL_ROLES = frozenset({"prefill"})
# ``both`` replicas decode too: in a mixed fleet a request may be served whole by one.
DECODE_ROLES = frozenset({"decode", "both"})


@dataclass(frozen=True, slots=True)
class LegShape:
    """How one API's prefill leg differs from the client's request, and how its usage reads."""

    set_fields: Mapping[str, Any]
    # Fields the one-token leg must not carry (a stream's options without a stream,
    # a minimum output above the one token asked for).
    drop_fields: frozenset[str]
    usage: Callable[[dict[str, Any]], Usage | None]
    # Whether a body can be disaggregated at all (one prompt: one set of params comes back).
    applies: Callable[[Mapping[str, Any]], bool] = lambda body: True

    def body(self, upstream: Mapping[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in upstream.items() if k not in self.drop_fields}
        out.update(self.set_fields)
        out["kv_transfer_params"] = dict(REMOTE_DECODE)
        return out


def _openai_usage(obj: dict[str, Any]) -> Usage | None:
    return Usage.from_obj(obj.get("usage"))


CHAT_LEG = LegShape({"stream": False, "max_tokens": 1, "max_completion_tokens": 1},
                    frozenset({"stream_options", "min_tokens"}), _openai_usage)
def _one_prompt(body: Mapping[str, Any]) -> bool:
    """A completions body with one prompt: a text, or one list of token ids. vLLM answers a batch of
    prompts with the first prompt's params only (``OpenAIServingCompletion``: ``final_res_batch[0]``),
    so a batch is prefilled where it decodes."""
    prompt = body.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))


# vLLM's CompletionRequest has no max_completion_tokens.
COMPLETIONS_LEG = LegShape({"stream": False, "max_tokens": 1}, frozenset({"stream_options", "min_tokens"}),
                           _openai_usage, _one_prompt)


def with_params(payload: bytes, params: Mapping[str, Any]) -> bytes:
    """The decode leg's body: the client's (a JSON object without the field: clients may not set
    it, ``policies.decision``) with the prefill replica's params, spliced in without a parse."""
    sep = b"," if len(payload) > 2 else b""
    return b"%s%s\"kv_transfer_params\":%s}" % (payload[:-1], sep, orjson.dumps(params))


class _Ewma:
    """A mean over about the last ``1 / weight`` samples; ``prior`` until the first."""

    __slots__ = ("value", "weight", "samples")

    def __init__(self, prior: float, weight: float) -> None:
        self.value, self.weight, self.samples = prior, weight, 0

    def add(self, x: float) -> None:
        self.samples += 1
        # The first samples weigh more (1/n), so the prior is forgotten at once.
        w = max(self.weight, 1.0 / self.samples)
        self.value += w * (x - self.value)


@dataclass
class Learned:
    """The two costs the decision needs beside routing's prefill rates, learned from the legs.

    Priors (before any leg measured them): 0 for both, the optimistic guess. The
    legs that measure them are the disaggregated ones, so a pessimistic prior
    (never disaggregate until shown to pay) would never be shown anything; with 0
    the first requests go remote, as an always-disaggregating router would, and
    the figures they return set the threshold from then on. A mean over about the
    last 32 legs: a change of load shows within seconds of P/D traffic, and one
    slow leg moves it by a thirty-second."""

    transfer: _Ewma = field(default_factory=lambda: _Ewma(0.0, 1 / 32))  # seconds per pulled token
    leg: _Ewma = field(default_factory=lambda: _Ewma(0.0, 1 / 32))  # the prefill leg's fixed round trip


@dataclass(slots=True)
class LegRecord:
    """One request's P/D path, kept on its context until the answer ends (``Disagg.finished``)."""

    decision: Decision | None
    prefill: str | None = None  # the prefill replica that returned params
    pulled: float = 0.0  # tokens the decode replica pulls (routing's estimate of what it lacks)
    decode_sent_at: float = 0.0


class Disagg:
    """The P/D stage, one per runtime: decides, runs the prefill leg, opens the decode leg."""

    def __init__(self, rt: "Runtime") -> None:
        self.rt = rt
        self.learned = Learned()
        self.decisions: Counter[tuple[str, str]] = Counter()  # (remote|local, reason)
        self.legs: Counter[tuple[str, str]] = Counter()  # (prefill|decode, ok|failed)
        self.fallbacks: Counter[tuple[str, str]] = Counter()  # (leg, retry|local)
        self.prefill_prompt = 0
        self.prefill_cached = 0
        self.transfer_tokens = 0.0
        # Decode replicas whose local prefill after a refused pull (``_recompute``) failed too, since
        # they last answered a decode leg: broken in themselves, they get no more local prefills.
        self.recompute_failed: set[str] = set()

    @property
    def active(self) -> bool:
        return self.rt.pool.disaggregated

    # -- the decision ------------------------------------------------------------------------
    def terms(self, route: RouteRequest, payload_len: int) -> tuple[Terms, "Replica | None", "Replica | None"]:
        """The decision's terms for ``route``, with the decode and prefill replicas routing would pick."""
        eligible = self.rt.pool.eligible(route.model)
        decoders = [r for r in eligible if r.role in DECODE_ROLES]
        prefillers = [r for r in eligible if r.role in PREFILL_ROLES]
        prompt = float(len(route.token_ids)) if route.token_ids else payload_len / CHARS_PER_TOKEN
        decode, uncached_d = self._pick(self.rt.policy, route, decoders, prompt)
        prefill, uncached_p = self._pick(self.rt.prefill_policy, route.leg(), prefillers, prompt)
        rate_d = decode.prefill_rate if decode is not None else None
        rate_p = prefill.prefill_rate if prefill is not None else None
        queued = load_now(prefill) * uncached_p if prefill is not None else 0.0
        terms = Terms(uncached_decode=uncached_d, uncached_prefill=uncached_p, rate_decode=rate_d,
                      rate_prefill=rate_p, decoding=load_now(decode) if decode is not None else 0.0,
                      prefill_wait_s=queued / rate_p if rate_p and rate_d else queued,
                      transfer_s_per_token=self.learned.transfer.value, leg_s=self.learned.leg.value)
        return terms, decode, prefill

    @staticmethod
    def _pick(policy: RoutingPolicy, route: RouteRequest, replicas: list["Replica"],
              prompt: float) -> tuple["Replica | None", float]:
        """The replica ``policy`` puts first, and the prompt tokens it would compute (its own
        estimate where the policy explains itself, else the whole prompt). Learns nothing."""
        if not replicas:
            return None, prompt
        explain = getattr(policy, "explain", None)
        if explain is None:
            return replicas[0], prompt
        rows = explain(route, replicas)
        first = rows[0]
        row = first._asdict() if hasattr(first, "_asdict") else first
        by_name = {r.name: r for r in replicas}
        return by_name.get(row["replica"], replicas[0]), float(row.get("uncached", prompt))

    def decide(self, route: RouteRequest, payload_len: int) -> tuple[Decision, Terms]:
        terms, decode, prefill = self.terms(route, payload_len)
        decision = decide(terms)
        if prefill is None:
            decision = _overrule(decision, "no_prefill_replica")
        elif decode is None:
            decision = _overrule(decision, "no_decode_replica")
        elif self.rt.settings.routing.disaggregation == "always" and not decision.remote:
            decision = _overrule(decision, "always", remote=True)
        return decision, terms

    def explain(self, route: RouteRequest, payload_len: int) -> dict[str, Any]:
        """For ``POST /admin/routing/explain``: the decision and its terms, nothing learned."""
        decision, terms = self.decide(route, payload_len)
        return {"mode": self.rt.settings.routing.disaggregation, "remote": decision.remote,
                "reason": decision.reason, "terms": {k: getattr(terms, k) for k in terms.__slots__},
                "figures": decision.as_dict()}

    # -- the legs ----------------------------------------------------------------------------
    async def open(self, ctx: "RequestContext", route: RouteRequest, call: UpstreamCall, leg: LegShape,
                   body: Mapping[str, Any]) -> Attempt:
        """The decode leg's response, opened after the prefill leg (or without one: local)."""
        rt = self.rt
        decision, terms = self.decide(route, len(call.payload))
        record = ctx.disagg = LegRecord(decision)
        rt.metrics.pd_decisions.labels("remote" if decision.remote else "local", decision.reason).inc()
        self.decisions["remote" if decision.remote else "local", decision.reason] += 1
        tried: set[str] = set()
        prefilled: set[str] = set()  # prefill replicas whose params a decode replica failed on
        budget = 0  # the pool's retry budget, held by a retried decode leg until its attempt ends
        try:
            for attempt_no in range(2):
                decode_call = call
                record.prefill, record.pulled = None, 0.0
                if decision.remote:
                    params = await self._prefill(ctx, route, call, leg, body, prefilled)
                    if params is not None:
                        decode_call = _replace_payload(call, with_params(call.payload, params))
                        record.pulled = _pulled(terms, params)
                try:
                    outcome = await self._decode(ctx, route, call, decode_call, tried, last=attempt_no == 1)
                except TimedOut as timed_out:
                    # No answer, or no first event, in time (the leg, or its local prefill): the
                    # client's 504, never retried, and a failed leg.
                    self._leg("decode", timed_out.replica, False)
                    raise
                if isinstance(outcome, Attempt):
                    outcome.budget_held, budget = outcome.budget_held + budget, 0
                    return outcome
                # Failed before its first byte: another decode replica, prefilled again (the blocks
                # the prefill replica pinned for this one expire there, as vLLM's lease does). On
                # another prefill replica too: a 500 from vLLM's decode is also what a failed pull
                # gives (kv_load_failure_policy "fail"), and the transfer may be what failed.
                failed, err = outcome
                budget = self._retry_decode(ctx, call, failed, err, record, tried, prefilled)
        finally:
            for _ in range(budget):
                rt.pool.budget.release()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _decode(self, ctx: "RequestContext", route: RouteRequest, call: UpstreamCall,
                      decode_call: UpstreamCall, tried: set[str], last: bool) -> Attempt | tuple[str, GatewayError]:
        """One decode leg (``decode_call``: the client's call, with params or without), and the local
        prefill on the same replica if it refused the params (``_recompute``). The attempt to relay
        (on the ``last`` try, whatever its status), or the replica that failed and its error."""
        rt = self.rt
        record = ctx.disagg
        assert record is not None
        record.decode_sent_at = time.perf_counter()
        try:
            attempt = await open_upstream(rt.pool, rt.policy, route, decode_call, rt.replica_keys, ctx.ticket,
                                          roles=DECODE_ROLES, exclude=tried)
        except SentAndDropped as dropped:
            # The params reached a replica that died before answering (or before its stream's
            # first event: ``UpstreamCall.first``): it may have pulled the blocks, and the prefill
            # replica frees what was read. Never send them again:
            # another decode replica, prefilled again, as after a 5xx.
            self._leg("decode", dropped.replica, False)
            if last:
                raise
            rt.policy.observe(route, RouteFeedback(dropped.replica, None, None, False))
            return dropped.replica, dropped
        status = attempt.response.status_code
        self._pulled_from(record.prefill, status < 500)
        if status >= 500 and record.prefill is not None and attempt.replica.name not in self.recompute_failed:
            replica = attempt.replica.name
            try:
                attempt = await self._recompute(ctx, route, call, attempt)
            except (NoReplica, UpstreamError) as exc:
                # Gone since it answered (ejected, or refusing connections): elsewhere, within the budget.
                if isinstance(exc, UpstreamError):
                    self.recompute_failed.add(replica)
                if last:
                    raise
                return replica, exc
            status = attempt.response.status_code
            if status >= 500:
                self.recompute_failed.add(replica)
        if status < 500:
            self.recompute_failed.discard(attempt.replica.name)
        if status < 500 or last:
            self._leg("decode", attempt.replica.name, status < 500)
            return attempt
        return attempt.replica.name, await self._drop(route, attempt)

    async def _recompute(self, ctx: "RequestContext", route: RouteRequest, call: UpstreamCall,
                         refused: Attempt) -> Attempt:
        """A decode leg that failed before its first byte while carrying a prefill replica's params,
        sent again to the same decode replica without them: it prefills locally. The refused attempt
        is closed; the local one is returned, whatever its status.

        Why not another prefill replica and another decode replica, as after any other failure: that
        is a retry, bounded by the pool's retry budget, and the budget is there for an overloaded
        fleet, where each retry adds load that is not there to give. A refused pull is not that. The
        decode replica refused before computing anything (vLLM's ``kv_load_failure_policy: fail``
        answers 500 as soon as the pull fails), and the fault is one prefill replica whose params
        cannot be pulled: when it starts failing, about every request it prefilled fails at once,
        far past the budget's share (20% of the requests in flight), before outlier detection has
        seen enough to eject it, and those clients got a 502 that the healthy decode replica could
        have avoided. Prefilling there costs what a local decision (``selective``) costs and moves
        no load to another replica; it is what vLLM's own ``kv_load_failure_policy: recompute`` does
        inside the decode replica. So it takes no budget.

        What keeps it from amplifying a real overload: it goes only to the replica that already had
        the request, at most once per decode replica a request reaches (moving to another still takes
        the budget). And a decode replica broken in itself fails this local attempt too: that counts
        against it (the call carries no params, so its failure is its own, towards ejection), and
        until it next answers a decode leg (``recompute_failed``) its refusals go straight to the
        budgeted retry elsewhere. Not its ``consecutive_failures``: a replica killed and started
        again keeps the count of the requests that died with it until its first success, and it
        would be refused the local prefill for the fault of another replica."""
        rt = self.rt
        record = ctx.disagg
        assert record is not None
        replica = refused.replica
        await self._drop(route, refused)
        self._fallback("decode", "local")
        log.warning("decode leg failed before its first byte with a prefill replica's params; prefilling locally",
                    extra={"request_id": ctx.request_id, "replica": replica.name, "prefill": record.prefill})
        # Nothing was pulled: no transfer to learn from, no prefill replica to tell of the answer.
        record.prefill, record.pulled = None, 0.0
        record.decode_sent_at = time.perf_counter()
        # That replica only. The call carries no params, so it is not ``once``: a failure is its own.
        others = {name for name in rt.pool.replicas if name != replica.name}
        return await open_upstream(rt.pool, rt.policy, route, call, rt.replica_keys, ctx.ticket,
                                   roles=DECODE_ROLES, exclude=others)

    async def _drop(self, route: RouteRequest, attempt: Attempt) -> GatewayError:
        """A decode leg that failed before its first byte: its error read, the leg counted and closed,
        and its placement's marks (backlog, requests in flight) taken off: the route is picked again."""
        err = await read_error_body(attempt.response, attempt.replica)
        self._leg("decode", attempt.replica.name, False)
        await attempt.close()
        self.rt.policy.observe(route, RouteFeedback(attempt.replica.name, None, None, False))
        return err

    def _pulled_from(self, prefill: str | None, ok: bool) -> None:
        """A decode leg that carried a prefill replica's params answered (``ok``) or failed before
        its first byte. vLLM's decode answers a failed pull with the same 500 as any other failure,
        so the failure is counted where the params came from: a prefill replica whose params cannot
        be pulled is ejected, not the decode replicas that tried them. A decode replica broken in
        itself is found all the same: once the prefill replicas are out, its requests prefill
        locally, and their failures are its own."""
        known = self.rt.pool.replicas.get(prefill) if prefill is not None else None
        if known is None:
            return
        if ok:
            self.rt.pool.record_success(known)
        else:
            self.rt.pool.record_failure(known, "pull")

    def _retry_decode(self, ctx: "RequestContext", call: UpstreamCall, replica: str, err: GatewayError,
                      record: "LegRecord", tried: set[str], prefilled: set[str]) -> int:
        """Whether the failed decode leg may go to another decode replica, as any retry may
        (``upstream.take_retry``: within the pool's retry budget, unless the replica is gone), or
        ``err`` raised. Returns the budget held."""
        rt = self.rt
        held = take_retry(rt.pool, call, isinstance(err, SentAndDropped) and err.gone)
        if held is None:
            raise err
        self._fallback("decode", "retry")
        tried.add(replica)
        if record.prefill is not None:
            prefilled.add(record.prefill)
        log.warning("decode leg failed before its first byte; retrying elsewhere",
                    extra={"request_id": ctx.request_id, "replica": replica, "error": str(err)})
        return held

    async def _prefill(self, ctx: "RequestContext", route: RouteRequest, call: UpstreamCall, leg: LegShape,
                       body: Mapping[str, Any], avoid: set[str]) -> dict[str, Any] | None:
        """Step 1 and 2: the params a prefill replica returns, or None (fall back to a local prefill)."""
        rt = self.rt
        timeouts = rt.settings.timeouts
        pcall = UpstreamCall(path=call.path, payload=orjson.dumps(leg.body(body)), headers=call.headers,
                             read_timeout_s=timeouts.first_byte_s, connect_timeout_s=call.connect_timeout_s,
                             max_attempts=call.max_attempts, priority=call.priority, moved=call.moved)
        tried = set(avoid)
        for attempt_no in range(2):
            proute = route.leg()
            started = time.perf_counter()
            try:
                attempt = await open_upstream(rt.pool, rt.prefill_policy, proute, pcall, rt.replica_keys, ctx.ticket,
                                              roles=PREFILL_ROLES, exclude=tried)
            except GatewayError as exc:
                self._fallback("prefill", "local")
                log.warning("no prefill replica took the leg; prefilling locally",
                            extra={"request_id": ctx.request_id, "error": str(exc)})
                return None
            replica = attempt.replica
            params, usage, answered, refused = None, None, False, False
            try:
                if attempt.response.status_code != 200:
                    failed = await read_error_body(attempt.response, replica)
                    raise failed if attempt.response.status_code >= 500 else _Refused(str(failed))
                _, obj = await read_whole(attempt.response, timeout_s=timeouts.first_byte_s)
                answered = True
                usage = leg.usage(obj)
                got = obj.get("kv_transfer_params")
                params = got if isinstance(got, dict) and got else None
                if params is None:
                    rt.pool.record_success(replica)
                # Else its health is told when a decode replica has pulled what it named (``open``).
            except (UpstreamError, UpstreamTimeout):
                rt.pool.record_failure(replica)
            except _Refused:
                refused = True
            finally:
                # Read whole and closed, its slot given back, before the decode leg opens.
                await attempt.close()
                # It computed the prompt if it answered, params or not: routing learns it holds it.
                # No time to first token: the leg's answer time, fed to ttft as one, taught it a
                # prediction error of about a whole prefill, within which it prefers the replica
                # computing fewer tokens, so legs queued on warm replicas (orgs_layered seed 1
                # p95 1.0-1.14 s against 0.78-0.87 s without, the same hit ratio: the P/D page).
                # Its rates are the replicas' own (/metrics), as on every fleet.
                rt.prefill_policy.observe(proute, RouteFeedback(replica.name, usage.prompt_tokens if usage else None,
                                                                usage.cached_tokens if usage else None, answered))
                route.adopt(proute)  # the decode leg reuses its analysis: hashed once
            ok = params is not None
            self._leg("prefill", replica.name, ok)
            if ok:
                self._prefilled(replica.name, usage, time.perf_counter() - started)
                assert ctx.disagg is not None
                ctx.disagg.prefill = replica.name
                return params
            tried.add(replica.name)
            if answered or refused or attempt_no == 1:
                # Answered without params (a replica with no KV connector on this route), refused
                # the request (4xx: the decode replica gives the client the verdict), or failed
                # twice: another prefill replica would most likely do the same.
                self._fallback("prefill", "local")
                return None
            self._fallback("prefill", "retry")
        return None

    def finished(self, ctx: "RequestContext", decode_replica: str, ttft_s: float | None) -> None:
        """The decode leg's answer ended: what it pulled, and the transfer's cost per token."""
        record = ctx.disagg
        if record is None or record.prefill is None:
            return
        pulled = record.pulled
        if pulled >= 1:
            self.transfer_tokens += pulled
            self.rt.metrics.pd_transfer_tokens.labels(decode_replica).inc(pulled)
            if ttft_s is not None:
                # The decode leg's time to its first token over the tokens it pulled: the pull, and
                # the first step it unblocks (the brief's estimate; it errs towards local).
                leg_ttft = ctx.started + ttft_s - record.decode_sent_at
                if leg_ttft > 0:
                    self.learned.transfer.add(leg_ttft / pulled)

    # -- accounting --------------------------------------------------------------------------
    def _prefilled(self, replica: str, usage: Usage | None, elapsed: float) -> None:
        m = self.rt.metrics
        if usage is not None and usage.prompt_tokens:
            self.prefill_prompt += usage.prompt_tokens
            self.prefill_cached += usage.cached_tokens or 0
            m.pd_prefill_tokens.labels("prompt", replica).inc(usage.prompt_tokens)
            m.pd_prefill_tokens.labels("cached", replica).inc(usage.cached_tokens or 0)
        known = self.rt.pool.replicas.get(replica)
        rate = known.prefill_rate if known is not None else None
        if rate and usage is not None:
            # The leg's fixed part: what it took beyond its own prefill at the replica's rate.
            computed = ((usage.prompt_tokens or 0) - (usage.cached_tokens or 0)) / rate
            self.learned.leg.add(max(0.0, elapsed - computed))

    def _leg(self, role: str, replica: str, ok: bool) -> None:
        self.legs[role, "ok" if ok else "failed"] += 1
        self.rt.metrics.pd_legs.labels(role, replica, "ok" if ok else "failed").inc()

    def _fallback(self, leg: str, to: str) -> None:
        self.fallbacks[leg, to] += 1
        self.rt.metrics.pd_fallbacks.labels(leg, to).inc()

    def stats(self) -> dict[str, Any]:
        """For ``/admin/status`` and the status page."""
        roles: dict[str, dict[str, int]] = {}
        for (role, outcome), n in self.legs.items():
            roles.setdefault(role, {"ok": 0, "failed": 0})[outcome] = n
        counts: Counter[str] = Counter(r.role for r in self.rt.pool.replicas.values())
        return {
            "active": self.active, "mode": self.rt.settings.routing.disaggregation, "replicas": dict(counts),
            "legs": roles,
            "decisions": {"remote": sum(n for (d, _), n in self.decisions.items() if d == "remote"),
                          "local": sum(n for (d, _), n in self.decisions.items() if d == "local"),
                          "reasons": {f"{d}:{r}": n for (d, r), n in sorted(self.decisions.items())}},
            "prefill_hit_ratio": self.prefill_cached / self.prefill_prompt if self.prefill_prompt else None,
            "transfer_tokens": round(self.transfer_tokens),
            "fallbacks": {f"{leg}:{to}": n for (leg, to), n in sorted(self.fallbacks.items())},
            "learned": {"transfer_s_per_token": self.learned.transfer.value,
                        "transfer_samples": self.learned.transfer.samples,
                        "leg_s": self.learned.leg.value, "leg_samples": self.learned.leg.samples},
        }


class _Refused(Exception):
    """The prefill replica refused the leg (4xx): the decode replica gives the client the verdict."""


def _overrule(d: Decision, reason: str, remote: bool = False) -> Decision:
    return Decision(remote, reason, d.local_s, d.stall_s, d.prefill_s, d.transfer_s, d.remote_s, d.saved_per_token,
                    d.threshold, d.headroom_s)


def _pulled(terms: Terms, params: Mapping[str, Any]) -> float:
    """Tokens the decode replica pulls: what routing believes it lacks, at most what the prefill
    replica says it computed (``remote_num_tokens``, vLLM's NixlConnector)."""
    computed = params.get("remote_num_tokens")
    if isinstance(computed, (int, float)) and not isinstance(computed, bool) and computed > 0:
        return min(terms.uncached_decode, float(computed))
    return terms.uncached_decode


def _replace_payload(call: UpstreamCall, payload: bytes) -> UpstreamCall:
    """The decode leg's call: the params it carries are sent to one replica at most (``once``). The
    rest is the client's call: its ``Moved`` shared, and a stream's wait for its first event."""
    return replace(call, payload=payload, once=True)
