"""Precise routing end to end: kvgate instances in front of simulated replicas that publish KV events.

Real parts throughout: vllm_sim replicas under uvicorn with their ZMQ PUB and
replay sockets, kvgate apps under uvicorn with the cost model and a real
tokenizer directory for the model (so requests carry token ids), the OpenAI
SDK as the client. Prompts are token-id completions, which the replicas
prefill as sent, so the test knows exactly which blocks each one caches.

* two instances that share nothing agree on every decision of a sequence, and
  it is the truth they agree on (a prompt extending a cached one follows it);
* a replica restarted mid-run is cleared and relearned, with no client error;
* a cut event stream degrades that replica to the approximate index (reported
  in /readyz and /admin/routing, still ready) and replay recovers it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import anyio
import httpx
import openai
import pytest

from gateway.admin import operations
from gateway.app import build_app
from gateway.runtime import Runtime
from gateway.settings import load_settings
from policies import cache_salt
from routing.base import RouteRequest
from routing.token_keys import block_keys
from routing.tokens import HFTokenSource
from tests.support.kv_sims import EventSim, token_prompt
from tests.support.servers import ServerThread
from tests.support.stack import MODEL
from vllm_sim.tokenizer_dir import build_tokenizer_dir

BS = 16
SECRET = "kv-events-test-secret"
SALT = cache_salt("default", SECRET)  # the open-mode tenant's salt, which kvgate sets on every request
ADAPTER = "sql-lora"  # a LoRA adapter served on MODEL


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok") / "model")


class Gateway:
    def __init__(self, sims: list[EventSim], tokenizer_dir: Path, **routing: Any) -> None:
        settings = load_settings(environ={}, overrides={
            "replicas": [s.replica_settings() for s in sims],
            "routing": {"tokenizers": {MODEL: str(tokenizer_dir)}, **routing},
            "pool": {"health_interval_s": 60, "metrics_interval_s": 60},
            "server_secret": SECRET,
        })
        self.server = ServerThread(build_app(settings, runtime=Runtime(settings))).start()
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0)

    @property
    def rt(self) -> Runtime:
        return self.server.config.app.state.runtime  # type: ignore[no-any-return]

    def peek(self, ids: list[int]) -> str:
        """Where this instance would send the request now (the policy's side-effect-free ``peek``)."""
        route = RouteRequest("completions", MODEL, "default",
                             {"model": MODEL, "prompt": ids, "max_tokens": 1, "cache_salt": SALT}, token_ids=ids)
        rt = self.rt
        return rt.policy.peek(route, rt.pool.eligible(MODEL))[0].name  # type: ignore[attr-defined]

    def send(self, ids: list[int]) -> str:
        raw = self.client.completions.with_raw_response.create(model=MODEL, prompt=ids, max_tokens=1)
        raw.parse()
        return raw.headers["x-kvgate-replica"]

    def held(self, ids: list[int], replica: str) -> float:
        kv = self.rt.kv_events
        assert kv is not None
        return kv.index.held(block_keys(ids, BS, SALT), [replica])[replica]

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the gateway's event loop, as the admin API calls it: the streams and the
        in-flight overlay change on that loop, and are read there."""
        async def call() -> Any:
            return fn()

        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(call(), self.server.loop).result(10)

    def routing(self) -> dict[str, Any]:
        return self.on_loop(lambda: operations.routing_stats(self.rt))  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        return self.on_loop(lambda: operations.status(self.rt))  # type: ignore[no-any-return]

    def readyz(self) -> httpx.Response:
        return httpx.get(self.server.url + "/readyz", timeout=5)

    def stop(self) -> None:
        self.server.stop()


def wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def all_precise(g: Gateway) -> bool:
    rows = g.routing()["kv_events"]["replicas"]
    return bool(rows) and all(r["mode"] == "precise" for r in rows.values())


@pytest.fixture
def fleet() -> Iterator[list[EventSim]]:
    sims = [EventSim(f"r{i}").start() for i in range(1, 4)]
    try:
        yield sims
    finally:
        for s in sims:
            s.stop()


def test_two_instances_that_share_nothing_agree_on_every_decision(fleet: list[EventSim], tokenizer_dir: Path) -> None:
    a, b = Gateway(fleet, tokenizer_dir), Gateway(fleet, tokenizer_dir)
    try:
        wait(lambda: all_precise(a) and all_precise(b))
        stems = [token_prompt(100 + f, 6)[: 6 * BS] for f in range(4)]
        sequence = [stems[i % 4] + token_prompt(i, 1 + i % 3) for i in range(16)]
        sequence += [sequence[i] + token_prompt(50 + i, 2) for i in range(4)]  # next turns of early requests
        placed: dict[int, str] = {}
        for i, ids in enumerate(sequence):
            expected = a.peek(ids)
            assert b.peek(ids) == expected, f"request {i}: the instances disagree"
            via = a if i % 2 == 0 else b
            assert via.send(ids) == expected
            blocks = len(ids) // BS
            wait(lambda ids=ids, at=expected, n=blocks: a.held(ids, at) == n and b.held(ids, at) == n)
            placed[i] = expected
            time.sleep(0.05)  # each instance's own prefill backlog drains (routing.backlog)
        for i in range(4):
            assert placed[16 + i] == placed[i]  # a next turn follows its cached prefix
        assert len(set(placed.values())) > 1  # and the stems spread over the fleet
        for g in (a, b):
            stats = g.routing()
            assert stats["precise_decisions"] >= 10
            assert all(r["gaps"] == 0 for r in stats["kv_events"]["replicas"].values())
    finally:
        a.stop()
        b.stop()


def test_a_restarted_replica_is_cleared_then_relearned_with_no_client_error(
        fleet: list[EventSim], tokenizer_dir: Path) -> None:
    g = Gateway(fleet, tokenizer_dir)
    try:
        wait(lambda: all_precise(g))
        warm: dict[str, list[int]] = {}
        seed = 0
        while len(warm) < 3 and seed < 200:  # one cached prompt on every replica
            ids = token_prompt(1000 + seed, 4)
            seed += 1
            replica = g.send(ids)
            warm.setdefault(replica, ids)
        victim = fleet[1]
        wait(lambda: g.held(warm[victim.name], victim.name) == 4)
        victim.stop()
        victim.start()  # same ports, empty cache, event sequence from 0
        wait(lambda: g.routing()["kv_events"]["replicas"][victim.name]["reconnects"] >= 2 and all_precise(g))
        assert g.held(warm[victim.name], victim.name) == 0  # cleared, not believed
        for i in range(12):  # the stream relearns, and every request is answered
            g.send(token_prompt(2000 + i, 3))
        assert g.rt.kv_events is not None and g.rt.kv_events.index.size(victim.name) > 0
        assert g.held(warm[fleet[0].name], fleet[0].name) == 4  # the others kept theirs
    finally:
        g.stop()


def test_a_cut_stream_degrades_to_approximate_and_replay_recovers(fleet: list[EventSim], tokenizer_dir: Path) -> None:
    g = Gateway(fleet, tokenizer_dir, kv_events={"stale_s": 0.3})
    try:
        wait(lambda: all_precise(g))
        victim = fleet[0]
        anyio.run(lambda: victim.faults(kv_events_drop=True))
        lost = None
        for i in range(60):  # until a request lands on the replica whose stream is cut
            ids = token_prompt(3000 + i, 3)
            if g.send(ids) == victim.name:
                lost = ids
                break
        assert lost is not None
        wait(lambda: g.routing()["kv_events"]["replicas"][victim.name]["mode"] == "approximate")
        ready = g.readyz()
        assert ready.status_code == 200  # degraded, not unready
        assert any(f"kv events {victim.name}: stale" in d for d in ready.json()["degraded"])
        metrics = httpx.get(g.server.url + "/metrics", timeout=5).text
        assert f'kvgate_kv_events_precise{{replica="{victim.name}"}} 0.0' in metrics
        assert f'kvgate_kv_events_precise{{replica="{fleet[1].name}"}} 1.0' in metrics
        for i in range(6):
            g.send(token_prompt(4000 + i, 2))  # served throughout, on the approximate index for the victim
        anyio.run(lambda: victim.faults())
        for i in range(60):  # the next batch from the victim jumps the sequence: the gap is replayed
            if g.send(token_prompt(5000 + i, 2)) == victim.name:
                break
        wait(lambda: all_precise(g))
        row = g.routing()["kv_events"]["replicas"][victim.name]
        assert row["gaps_replayed"] == 1 and row["resets"] == 0
        assert g.held(lost, victim.name) == 3  # the lost batch came back through replay
        assert not any("kv events" in d for d in g.readyz().json()["degraded"])
    finally:
        g.stop()


def _protocol_body(endpoint: str, n: int) -> dict[str, Any]:
    """A Messages or Responses request with its own long system prompt (about ten blocks)."""
    system = f"Agent {n} for {endpoint}: " + " ".join(f"rule{n}x{i} keeps the prefix stable" for i in range(30))
    if endpoint == "messages":
        return {"model": MODEL, "max_tokens": 1, "system": system, "messages": [{"role": "user", "content": "go"}]}
    return {"model": MODEL, "max_output_tokens": 1, "instructions": system, "input": "go"}


def test_messages_and_responses_requests_follow_the_replica_holding_their_tokens(
        fleet: list[EventSim], tokenizer_dir: Path) -> None:
    """Their token ids come from vLLM's conversion to chat (routing.vllm_chat): a replica whose
    events show those blocks is where each request goes, whichever replica that is."""
    g = Gateway(fleet, tokenizer_dir)
    try:
        wait(lambda: all_precise(g))
        source = g.rt.tokenization.sources[MODEL]
        assert isinstance(source, HFTokenSource)
        for endpoint, path in (("messages", "/v1/messages"), ("responses", "/v1/responses")):
            for n, holder in enumerate(fleet):  # each replica in turn holds one request's prompt
                body = _protocol_body(endpoint, n)
                ids = source.ids(endpoint, body)
                assert ids is not None and len(ids) >= 8 * BS
                anyio.run(holder.complete, ids, SALT)  # the replica prefills exactly those ids
                wait(lambda ids=ids, holder=holder: g.held(ids, holder.name) == len(ids) // BS)
                r = httpx.post(g.server.url + path, json=body, timeout=10)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvgate-replica"] == holder.name, f"{endpoint} request {n}"
                time.sleep(0.05)  # this instance's own prefill backlog drains (routing.backlog)
        row = g.routing()["tokenization"]["models"][MODEL]["endpoints"]
        assert row["messages"] == {"exact": 3, "fallback": 0}
        assert row["responses"] == {"exact": 3, "fallback": 0}
        assert g.routing()["precise_decisions"] >= 6
    finally:
        g.stop()


def test_token_ids_that_are_not_the_replicas_are_found_out_and_routed_approximately(
        fleet: list[EventSim], tokenizer_dir: Path) -> None:
    """kvgate tokenizes chat with the directory's tokenizer; these replicas render and tokenize
    chat their own way (no --tokenizer), so the blocks they store are never the ones kvgate
    looks up. Each replica is found out once its last 16 served requests all failed to appear
    in its events; token-id prompts, which the replicas prefill as sent, agree and restore it."""
    g = Gateway(fleet, tokenizer_dir, kv_events={"stale_s": 0.3})
    try:
        wait(lambda: all_precise(g))

        def rows() -> dict[str, Any]:
            return g.routing()["kv_events"]["replicas"]  # type: ignore[no-any-return]

        def chat(i: int) -> None:
            g.client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
                {"role": "system", "content": f"You are assistant number {i}, terse and exact."},
                {"role": "user", "content": f"Question {i}: what does a KV cache keep between requests?"}])

        sent = iter(range(10_000))
        wait(lambda: chat(next(sent)) or all(r["token_agreement"]["disagrees"] for r in rows().values()),
             timeout=30)
        for r in rows().values():
            assert r["mode"] == "approximate" and r["state"] == "live"  # the stream itself is fine
            assert r["token_agreement"]["unconfirmed"] >= 16 and r["token_agreement"]["confirmed"] == 0
        ready = g.readyz()
        assert ready.status_code == 200  # still serving, only less precisely
        assert {r["routing"] for r in g.status()["replicas"]} == {"approximate: token ids disagree"}
        metrics = httpx.get(g.server.url + "/metrics", timeout=5).text
        for sim in fleet:
            assert f'kvgate_kv_events_precise{{replica="{sim.name}"}} 0.0' in metrics
            assert f'kvgate_kv_events_token_checks_total{{appeared="yes",replica="{sim.name}"}} 0.0' in metrics
        assert sum("are not the replica's" in d for d in ready.json()["degraded"]) == len(fleet)
        # Token ids the replicas prefill as sent: they appear, and each replica is precise again.
        n = iter(range(10_000))
        wait(lambda: g.send(token_prompt(500 + next(n), 3)) and all_precise(g), timeout=30)
        assert all(r["token_agreement"]["confirmed"] >= 1 for r in rows().values())
        assert {r["routing"] for r in g.status()["replicas"]} == {"precise"}  # the status page's column
        assert not any("are not the replica's" in d for d in g.readyz().json()["degraded"])
    finally:
        g.stop()


def test_a_lora_adapters_requests_follow_its_own_blocks_not_its_base_models(tokenizer_dir: Path) -> None:
    """vLLM hashes every block of an adapter's request with the adapter, so the same prompt under
    the adapter and under the base model shares nothing. kvgate keys them apart once the events
    have named the adapter: each request goes to the replica holding its own blocks."""
    sims = [EventSim(f"r{i}", lora_modules=((ADAPTER, "/adapters/sql"),)).start() for i in range(1, 4)]
    g = Gateway(sims, tokenizer_dir, tokenizers={MODEL: str(tokenizer_dir), ADAPTER: str(tokenizer_dir)})
    try:
        wait(lambda: all_precise(g))
        kv = g.rt.kv_events
        assert kv is not None
        # Known from the replicas' /v1/models (its parent is the base model) before any event names it.
        wait(lambda: ADAPTER in kv.index.adapters)
        for n, (base_at, lora_at) in enumerate([(0, 1), (1, 2), (2, 0)]):
            ids = token_prompt(900 + n, 6)
            anyio.run(sims[base_at].complete, ids, SALT)
            anyio.run(lambda ids=ids, at=lora_at: sims[at].complete(ids, SALT, model=ADAPTER))
            blocks = len(ids) // BS
            base, lora = block_keys(ids, BS, SALT), block_keys(ids, BS, SALT, lora=ADAPTER)
            wait(lambda base=base, lora=lora, b=sims[base_at].name, a=sims[lora_at].name, k=blocks:
                 kv.index.held(base, [b])[b] == k and kv.index.held(lora, [a])[a] == k)
            assert ADAPTER in kv.index.adapters
            # Each replica holds one of the two: the other's blocks are not there.
            assert kv.index.held(lora, [sims[base_at].name])[sims[base_at].name] == 0
            assert kv.index.held(base, [sims[lora_at].name])[sims[lora_at].name] == 0
            for model, holder in ((ADAPTER, lora_at), (MODEL, base_at)):
                raw = g.client.completions.with_raw_response.create(model=model, prompt=ids, max_tokens=1)
                assert raw.headers["x-kvgate-replica"] == sims[holder].name, (n, model)
                # It found its own blocks there: all of them (vLLM recomputes a last block that is all cached).
                cached = raw.parse().usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
                assert cached == (len(ids) - 1) // BS * BS, (n, model)
                time.sleep(0.05)  # this instance's own prefill backlog drains (routing.backlog)
        assert ADAPTER in {m["id"] for m in httpx.get(g.server.url + "/v1/models", timeout=5).json()["data"]}
    finally:
        g.stop()
        for s in sims:
            s.stop()
