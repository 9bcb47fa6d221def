"""P/D disaggregation: the simulator speaks vLLM 0.33's NixlConnector protocol (pull mode).

A router sends each request twice. To a prefill replica with
``kv_transfer_params: {"do_remote_decode": true, ...}`` and ``max_tokens`` 1: it
prefills, answers, and returns ``kv_transfer_params`` naming its blocks; then the
original request, with those params, to a decode replica, which pulls the blocks it
does not hold and decodes. Here a replica's side channel is ``POST /sim/nixl/read`` on
its own HTTP port (vLLM's is a ZMQ handshake on ``VLLM_NIXL_SIDE_CHANNEL_PORT`` and the
KV moves by NIXL reads; one HTTP call stands in for both).

What vLLM 0.33 does, and where (paths under ``vllm/``):

- The router's steps are those of vLLM's toy proxy
  (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` in vLLM's repository;
  not in the wheel), and of ``vllm-router --vllm-pd-disaggregation`` (what it sends:
  ``bench/vllm_router.py``): the prefill leg with ``do_remote_decode`` true, the other
  fields null, ``stream`` false and ``max_tokens`` 1; the decode leg with the params the
  prefill returned.

- The params are a request field (``kv_transfer_params: dict | None``) of chat and
  completions (``entrypoints/openai/chat_completion/protocol.py``,
  ``completion/protocol.py``), responses (``responses/protocol.py``) and Anthropic messages
  (``entrypoints/anthropic/protocol.py``); each route's response echoes what the connector
  returned in a ``kv_transfer_params`` field (chat and completions also on the final
  stream chunk; the simulator sets it on whole responses only).
- The prefill's dict is built by ``NixlPullConnectorScheduler.request_finished``
  (``distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``) for a request whose
  params say ``do_remote_decode`` and that finished by stop or length (an abort frees at
  once and returns nothing): ``do_remote_prefill`` True, ``do_remote_decode`` False,
  ``remote_block_ids`` (one list of block ids per KV cache group, covering the computed
  tokens), ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``
  (the side channel), ``tp_size``, ``dcp_size``, ``pp_size``, ``remote_num_tokens`` (the
  computed tokens), ``remote_blocks_expiry_time`` (None on a prefill),
  ``remote_registration_generation`` (0) and ``transfer_mode`` ("pull"). The scheduler then
  adds ``remote_prefill_cached_tokens``, the prefill's own cache hit
  (``v1/core/sched/scheduler.py``, ``update_from_output``).
- The prefill keeps those blocks until the decode has read them, or until the lease
  ``kv_lease_duration`` (extra config, 30 s; ``nixl/base_scheduler.py``) runs out;
  then it frees them and counts ``vllm:nixl_num_kv_expired_reqs``
  (``base_worker.py``, ``_reap_expired_send_leases``). (A decode that has the request
  queued renews the lease by heartbeats; here the decode pulls on arrival, so none.)
- The decode pulls when its scheduler admits the request (it allocates the blocks, then
  waits in WAITING_FOR_REMOTE_KVS while they arrive). The simulator pulls when the request
  arrives, before it queues; local blocks evicted in between are counted as pulled at
  admission (``RemoteLoad.late``), so none of a remote prefill's prompt is computed here.
- The decode asks the connector for the prompt tokens beyond its own block-aligned
  prefix hit (``get_num_new_matched_tokens``: ``len(prompt) - num_computed_tokens``), so
  only the blocks it lacks move; a full local hit pulls nothing but still tells the
  prefill to free (``update_state_after_alloc``). Pulled blocks are cached like computed
  ones (``Scheduler._update_waiting_for_remote_kv``: ``cache_blocks``), so KV events show
  them as ``BlockStored``; the last prompt token is recomputed.
- Params lacking an engine id, request id, host or port are ignored with a warning
  ("Got invalid KVTransferParams"): the request is served as a plain one.
- A pull that fails (handshake refused: no such engine, or the engine id differs) goes
  through ``kv_transfer_config.kv_load_failure_policy`` (``config/kv_transfer.py``):
  "fail" (default) ends the request with finish reason "error", which the server turns
  into HTTP 500 "Internal server error"; "recompute" prefills locally. The decode counts
  ``vllm:nixl_num_failed_transfers``.
- A read of blocks whose lease had expired is not detected by the decode: the prefill
  logs "Potentially invalid KV blocks ... may have expired" and counts
  ``vllm:nixl_num_notifications_after_expiry`` (``nixl/pull_worker.py``), and the decode
  goes on with whatever the blocks hold. Freed blocks keep their content until reused,
  so the simulator answers right while the prefill's pool still caches the blocks, and
  otherwise (evicted, or a request id it never held) with another, wrong, reply: what a
  router's wrong-answer check should catch. A second read of blocks already read and
  freed (a decode leg retried with the same params) is the same case.
- The decode's ``cached_tokens`` is the prefill's ``remote_prefill_cached_tokens`` when
  the params carry it (``v1/engine/output_processor.py``), else local plus pulled
  tokens. Pulled tokens count in ``vllm:external_prefix_cache_queries``/``_hits``, the
  local hit in ``vllm:prefix_cache_*``; each pull's duration in
  ``vllm:nixl_xfer_time_seconds``. The ``vllm_sim:kv_*`` series (transfers, blocks and
  tokens pulled, remote prefills, blocks held) have no vLLM counterpart.

Not modelled: tensor, pipeline or decode-context parallelism (``tp_size`` and the others
are 1), heartbeats, the push mode (``NixlPushConnector``), bidirectional transfers, and the
prefill's trailing-token backoff (0 for plain attention models).

Roles (``--role``): "both" accepts both kinds of params, as vLLM's ``kv_both``; "prefill"
refuses ``do_remote_prefill`` and "decode" refuses ``do_remote_decode`` with a 400, where
vLLM's connector does not look at the role per request (``nixl/pull_scheduler.py``) and a
real ``kv_producer``/``kv_consumer`` would misbehave quietly: a test should learn that a
router sent a leg to the wrong side. All roles serve plain requests, as vLLM does. (vLLM
0.33 warns that ``kv_both`` with NixlConnector is deprecated in favour of ``kv_producer``
for prefill instances and ``kv_consumer`` for decode ones: ``nixl/connector.py``.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Sequence

import httpx

from vllm_sim.engine import GenRequest, Generation, RemoteLoad
from vllm_sim.stats import Histogram
from vllm_sim.wire import ApiError

if TYPE_CHECKING:
    from vllm_sim.config import SimConfig
    from vllm_sim.kv import Allocation, KVPool
    from vllm_sim.timing import TimingModel

__all__ = ["PD", "PDStats", "PullFailed", "Leg", "leg_of", "REMOTE_KEYS", "XFER_TIME_BUCKETS"]

log = logging.getLogger("vllm_sim.pd")

Leg = Literal["prefill", "decode"]

# The fields a decode needs to find the prefill (pull_scheduler.update_state_after_alloc).
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
# The side channel's answer for a request whose blocks are gone (reused, or never held).
_GONE = 410
# vllm:nixl_xfer_time_seconds's bounds (nixl/stats.py, NixlPromMetrics).
XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
# Released requests (read, or their lease expired) remembered, so a late read can tell
# whether their blocks were reused since.
_RELEASED_KEPT = 1024


class PullFailed(Exception):
    """The pull failed and the policy is "fail": the route answers as vLLM does (500)."""


def leg_of(params: Any) -> Leg | None:
    """Which P/D leg a request's ``kv_transfer_params`` asks for; raises ``ApiError`` on a bad type."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params must be an object.", param="kv_transfer_params")
    if params.get("do_remote_prefill"):
        return "decode"
    if params.get("do_remote_decode"):
        return "prefill"
    return None


@dataclass(slots=True)
class PDStats:
    # Decode side: pulls that moved blocks, the blocks and tokens moved, failed pulls.
    transfers: int = 0
    transfer_blocks: int = 0
    transfer_tokens: int = 0
    failed_transfers: int = 0
    stale_reads: int = 0
    # vLLM's connector prefix-cache counters: tokens asked of the connector, and loaded.
    external_queries: int = 0
    external_hits: int = 0
    # Prefill side: requests prefilled for a remote decode, their blocks read, leases run out,
    # and reads of requests no longer held.
    remote_prefills: int = 0
    reads: int = 0
    kv_expired_reqs: int = 0
    notifications_after_expiry: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class _Held:
    allocations: list[Allocation]
    block_ids: list[int]
    timer: asyncio.TimerHandle | None = field(default=None)


class PD:
    """One replica's side of the protocol: the blocks it holds for decodes, and its pulls."""

    def __init__(self, config: SimConfig, pool: KVPool, timing: TimingModel) -> None:
        self.config = config
        self.pool = pool
        self.timing = timing
        self.role = config.role
        self.engine_id = config.engine_id or str(uuid.uuid4())
        self.stats = PDStats()
        # Each pull's duration (scaled seconds), as vllm:nixl_xfer_time_seconds.
        self.xfer_seconds = Histogram(XFER_TIME_BUCKETS)
        self._held: dict[str, _Held] = {}
        self._released: OrderedDict[str, list[bytes]] = OrderedDict()
        # Block ids for the params: the simulator's blocks have hashes, not addresses.
        self._ids = itertools.count()
        self._client: httpx.AsyncClient | None = None

    @property
    def side_channel(self) -> tuple[str, int]:
        host = self.config.side_channel_host or self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return host, self.config.side_channel_port or self.config.port

    @property
    def held_requests(self) -> int:
        return len(self._held)

    def check_leg(self, leg: Leg | None) -> None:
        """Refuse the leg this replica's role does not serve (see the module docstring)."""
        if leg == "decode" and self.role == "prefill":
            raise ApiError(400, "This replica runs with --role prefill (kv_producer): it cannot load KV from "
                                "a remote prefill (kv_transfer_params.do_remote_prefill).",
                           param="kv_transfer_params")
        if leg == "prefill" and self.role == "decode":
            raise ApiError(400, "This replica runs with --role decode (kv_consumer): it does not prefill for "
                                "a remote decode (kv_transfer_params.do_remote_decode).",
                           param="kv_transfer_params")

    async def begin(self, request: GenRequest, params: dict[str, Any] | None) -> None:
        """Before the engine: a prefill leg keeps its blocks when done; a decode leg pulls first.

        Raises ``ApiError`` for a leg this role refuses, ``PullFailed`` under the "fail" policy."""
        leg = leg_of(params)
        self.check_leg(leg)
        if leg == "prefill":
            request.hold_blocks = True
        elif leg == "decode" and params is not None:
            await self.pull(request, self.pool.hash_prompt(request.prompt_tokens, request.cache_salt, request.lora),
                            params)

    # -- prefill side ----------------------------------------------------------------------
    def finished(self, request: GenRequest, gen: Generation) -> dict[str, Any] | None:
        """The params a prefill returns, as ``request_finished`` builds them; holds the blocks."""
        if not request.hold_blocks or not gen.held:
            return None
        allocations, gen.held = gen.held, []
        computed = gen.prompt_tokens + max(0, gen.completion_tokens - 1)
        block_ids = [next(self._ids) % self.pool.num_blocks for _ in range(self.pool.blocks_for(computed))]
        held = _Held(allocations, block_ids)
        lease = self.config.kv_lease_s * (self.timing.time_scale or 1.0)
        held.timer = asyncio.get_running_loop().call_later(lease, self._expire, request.request_id)
        self._held[request.request_id] = held
        self.stats.remote_prefills += 1
        host, port = self.side_channel
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": computed,
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": gen.cached_tokens,
        }

    def _expire(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            log.warning("Releasing expired KV blocks for request %s", request_id)
            self.stats.kv_expired_reqs += 1
            self._release(request_id, held)

    def _release(self, request_id: str, held: _Held) -> None:
        self._free(held)
        self._released[request_id] = [h for a in held.allocations for h in a.pinned]
        if len(self._released) > _RELEASED_KEPT:
            self._released.popitem(last=False)

    def _free(self, held: _Held) -> None:
        if held.timer is not None:
            held.timer.cancel()
        for allocation in held.allocations:
            self.pool.release(allocation)

    def read(self, body: Any) -> tuple[int, dict[str, Any]]:
        """The side channel: a decode reads (or, with no block ids, just releases) a request's blocks."""
        if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
            return 400, {"error": "request_id is required"}
        if body.get("engine_id") != self.engine_id:
            # vLLM's handshake checks the engine id: "Remote NIXL agent engine ID mismatch".
            return 404, {"error": f"Remote NIXL agent engine ID mismatch: this is {self.engine_id}"}
        held = self._held.pop(body["request_id"], None)
        if held is None:
            log.error("Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode "
                      "worker. They may have expired.", body["request_id"])
            self.stats.notifications_after_expiry += 1
            hashes = self._released.get(body["request_id"])
            if hashes is not None and self.pool.match(hashes) == len(hashes):
                return 200, {"after_expiry": True}  # freed but not reused yet: the KV is still right
            return _GONE, {"error": "unrecognized request: its blocks may have expired"}
        self.stats.reads += 1
        self._release(body["request_id"], held)
        return 200, {"block_ids": held.block_ids}

    # -- decode side -----------------------------------------------------------------------
    async def pull(self, request: GenRequest, hashes: Sequence[bytes], params: dict[str, Any]) -> None:
        """Pull the prompt blocks this replica lacks; sets ``request.remote`` (or ``stale_kv``).

        Leaves the request plain when the params are incomplete, or when the pull failed
        under the "recompute" policy; raises ``PullFailed`` under "fail"."""
        if not all(params.get(k) is not None for k in REMOTE_KEYS) or not params.get("remote_block_ids"):
            log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params)
            return
        bs = self.pool.block_size
        num_prompt = len(request.prompt_tokens)
        # vLLM's local hit stops before the last token, and the connector counts from its block boundary.
        local_blocks = min(self.pool.match(hashes), (num_prompt - 1) // bs)
        local_tokens = local_blocks * bs
        groups = params["remote_block_ids"]
        remote_ids = groups[0] if groups and isinstance(groups[0], list) else groups
        to_pull = list(remote_ids[local_blocks:])
        count = num_prompt - local_tokens
        status = await self._read(params, to_pull)
        if status not in (200, _GONE):
            self.stats.failed_transfers += 1
            if self.config.kv_load_failure_policy == "fail":
                raise PullFailed(f"KV load from engine {params['remote_engine_id']} failed")
            return  # recompute: the request is prefilled here like a plain one
        if status == _GONE:
            self.stats.stale_reads += 1
            request.stale_kv = True
        self.stats.external_queries += count
        self.stats.external_hits += count
        if to_pull:
            self.stats.transfers += 1
            self.stats.transfer_blocks += len(to_pull)
            self.stats.transfer_tokens += count
            seconds = self.timing.transfer_time(count)
            self.xfer_seconds.observe(seconds)
            await asyncio.sleep(seconds)
        cached = params.get("remote_prefill_cached_tokens")
        request.remote = RemoteLoad(local_tokens, cached if isinstance(cached, int) else None, self._pulled_late)

    def _pulled_late(self, tokens: int) -> None:
        # Local blocks evicted before admission: vLLM, deciding at admission, would have pulled them.
        self.stats.transfer_tokens += tokens
        self.stats.external_queries += tokens
        self.stats.external_hits += tokens

    async def _read(self, params: dict[str, Any], block_ids: list[int]) -> int:
        url = f"http://{params['remote_host']}:{params['remote_port']}/sim/nixl/read"
        body = {"engine_id": params["remote_engine_id"], "request_id": params["remote_request_id"],
                "block_ids": block_ids}
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=30.0)
        try:
            response = await self._client.post(url, json=body)
        except httpx.HTTPError as exc:
            log.warning("NIXL handshake with %s failed: %s", url, exc)
            return 0
        return response.status_code

    # -- life cycle ------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.stats = PDStats()
        self.xfer_seconds = Histogram(XFER_TIME_BUCKETS)

    async def aclose(self) -> None:
        for held in self._held.values():
            self._free(held)
        self._held.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
