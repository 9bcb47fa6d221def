"""The shared store: entries in Redis, a change log for other instances.

Layout (``P`` = ``settings.key_prefix``, default ``kvgate:sc:``):

* ``P e:<id>``      hash: the entry (see ``store.encode_entry``), with a TTL.
* ``P ns:<ns>``     sorted set: entry ids of a namespace scored by last use
                    (``_PUT`` trims the least recently used).
* ``P namespaces``  set of namespaces (purge-all, rebuild).
* ``P log``         stream of ``add``/``del`` events, capped; instances tail it
                    to keep their in-memory indexes in sync within a second.
* ``P generation``  a random token, set by the first instance to ask: it names
                    this data set. A Redis that restarted empty (or was flushed)
                    has none or another, and every instance resynchronises.

On a Redis Cluster (``connect`` returns a ``RedisCluster``) ``P`` becomes a hash
tag, ``{kvgate:sc:}``: every key above shares one slot, so the scripts in
``put`` and ``set_vector`` stay atomic. The cache then lives on one shard (it does
not spread over the cluster); the stream is one key anyway.

Reads of an entry (``get``) and writes (``put``, ``set_vector``) are batched
(``batching.Batcher``), each in its own batches, alike: a lone write
goes at once; writes that arrive while a batch is on the wire go together in the
next one, one pipelined round trip carrying all their scripts. Eight answers
completing at once then cost one round trip, not eight queued ones. A batch
carries at most ``max_connections`` writes: never more than could have been in
flight unbatched, so it holds the single-threaded server no longer than they
would have. A batch that fails fails each of its writes with ``StoreUnavailable``
(the cache counts each as a failed store; nothing is served from it). To the
breaker it is one failed round trip however many writes it carried: one slow reply
on a busy machine is one piece of evidence, not thirty. One script's error fails
its own write only.

Faults. Every call is bounded by the client's socket timeouts (connect and
read = ``redis_timeout_s``) with no client retries, so a hung Redis costs at
most one timeout; at most ``max_connections`` calls are in flight, the rest
wait (bounded by the same timeout) instead of opening sockets in a burst. A
refused connection, or ``breaker_failures`` consecutive errors, open a circuit
breaker: from then on calls fail at once with ``StoreUnavailable`` (no socket
is touched) until the background probe gets a PING through; then the breaker
closes and the sync loop resynchronises what it missed.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, Callable

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .batching import Batcher
from .models import Entry
from .store import PurgeFilter, StoreUnavailable, decode_entry, encode_entry

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError, TimeoutError)
_CHUNK = 256

# One write for the batched pipeline: (script, keys, args).
_Eval = tuple[str, list[str], list[Any]]

# Store one entry and keep its namespace within ``cap``, in one atomic step (one round trip,
# and one command for the client to encode instead of a seven-command MULTI: the write a
# response waits for). A replaced entry must not keep an old vector field, so DEL first.
# Concurrent puts that each saw "over the cap" must not each evict their own surplus (that
# empties a namespace), and an evicted id loses its hash in the same step, before another
# put can re-create it. Returns the evicted ids.
_PUT = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
redis.call('EXPIREAT', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'op', 'add', 'id', ARGV[3], 'src', ARGV[5])
local cap = tonumber(ARGV[7])
if redis.call('ZCARD', KEYS[2]) <= cap then return {} end
local victims = redis.call('ZRANGE', KEYS[2], 0, -(cap + 1))
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -(cap + 1))
for _, id in ipairs(victims) do redis.call('DEL', ARGV[8] .. id) end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'op', 'del', 'id', table.concat(victims, ' '),
           'src', ARGV[5])
return victims
"""

# Add a vector to an entry only if it is still the version written (same ``created``, same
# embedder): a hash that expired, was evicted, purged or replaced meanwhile is not touched
# (HSET on a missing key would re-create a partial entry). Logged as an "add": other
# instances fetch the entry again, now with its vector.
_SET_VECTOR = """
if redis.call('HGET', KEYS[1], 'created') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'emb') ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'vec', ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'op', 'add', 'id', ARGV[4], 'src', ARGV[5])
return 1
"""


class CircuitBreaker:
    """Closed: calls go through. Open: calls fail fast until ``reset``.

    Opens after ``threshold`` consecutive availability errors, or at once on a
    refused connection (nothing is listening: no point in asking again). One
    slow reply in a burst should not turn the cache off; a hung server fails
    every in-flight call together, so it still opens after one timeout's wait.
    """

    def __init__(self, threshold: int = 3) -> None:
        self.threshold = threshold
        self.failures = 0
        self.open_since: float | None = None
        self.trips = 0
        self.last_error = ""

    @property
    def is_open(self) -> bool:
        return self.open_since is not None

    def failure(self, error: str, *, fatal: bool = False) -> None:
        self.failures += 1
        self.last_error = error
        if (fatal or self.failures >= self.threshold) and self.open_since is None:
            self.open_since = time.monotonic()
            self.trips += 1

    def success(self) -> None:
        self.failures = 0

    def reset(self) -> None:
        self.failures = 0
        self.open_since = None


def _refused(exc: BaseException | None) -> bool:
    """Whether a connection was refused (redis-py wraps the OSError; walk the chain)."""
    for _ in range(5):
        if exc is None:
            return False
        if isinstance(exc, ConnectionRefusedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _describe(exc: BaseException) -> str:
    inner = exc.__cause__ or exc.__context__
    return f"{exc!r} ({inner!r})" if inner is not None else repr(exc)


def _client(url: str, timeout_s: float) -> aioredis.Redis:
    # No client-side retries: a retry on a hung server multiplies the time a request waits.
    return aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 0), health_check_interval=0)


class RedisStore:
    def __init__(self, url: str, *, timeout_s: float, prefix: str, ttl_s: int, embedder: str,
                 stream_maxlen: int, sync_block_ms: int, probe_interval_s: float, instance_id: str,
                 max_connections: int = 32, breaker_failures: int = 3,
                 connect: Callable[[float, float], Any] | None = None) -> None:
        """``connect(timeout_s, read_timeout_s)`` builds a client (e.g. a ``RedisCluster``,
        see ``gateway.redis_client``); by default a single-server client for ``url``."""
        self._timeout = timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._me = instance_id
        self._p = prefix
        self._ttl = ttl_s
        self._embedder = embedder
        self._maxlen = stream_maxlen
        self._block_ms = sync_block_ms
        self._probe_interval = probe_interval_s
        connect = connect or (lambda t, read: _client(url, read))
        self._r = connect(timeout_s, timeout_s)
        # The log reader blocks server-side for up to block_ms: its read timeout must exceed that.
        self._tail = connect(timeout_s, timeout_s + sync_block_ms / 1000)
        if isinstance(self._r, aioredis.RedisCluster) and "{" not in prefix:
            self._p = "{" + prefix + "}"  # one hash slot for every key (see the module docstring)
        self.breaker = CircuitBreaker(breaker_failures)
        self._writes: Batcher[_Eval, Any] = Batcher(self._write_batch, max_connections, name="kvgate-sc-writes")
        self._reads: Batcher[tuple[str, str], Any] = Batcher(self._read_batch, max_connections,
                                                             name="kvgate-sc-reads")
        self._probe: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def healthy(self) -> bool:
        return not self.breaker.is_open

    @property
    def writes(self) -> Batcher[_Eval, Any]:
        return self._writes

    def _k(self, kind: str, name: str = "") -> str:
        return f"{self._p}{kind}{name}"

    async def _call(self, fn: Callable[[aioredis.Redis], Any], client: Any = None) -> Any:
        """Run one Redis interaction under the breaker; any fault becomes StoreUnavailable.

        Typed ``Any``: redis-py annotates replies as unions of every RESP type."""
        if self.breaker.is_open:
            raise StoreUnavailable("redis circuit breaker open")
        if client is not None:
            return await self._guarded(fn, client)
        # Bound the connections in use: a burst of requests queues here (briefly) instead of
        # opening hundreds of sockets whose handshakes time out and look like an outage.
        try:
            async with asyncio.timeout(self._timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise StoreUnavailable("redis client busy") from None
        try:
            return await self._guarded(fn, self._r)
        finally:
            self._slots.release()

    async def _guarded(self, fn: Callable[[aioredis.Redis], Any], client: aioredis.Redis) -> Any:
        try:
            result = await fn(client)
        except _UNAVAILABLE as exc:
            self.breaker.failure(_describe(exc), fatal=_refused(exc))
            if self.breaker.is_open:
                self._ensure_probe()
            raise StoreUnavailable(repr(exc)) from exc
        except RedisError as exc:  # a server-side error (wrong type, OOM): not an outage
            raise StoreUnavailable(repr(exc)) from exc
        self.breaker.success()
        return result

    # ---- health ----

    async def start(self) -> bool:
        """Check the connection once; when it fails, start degraded and keep probing."""
        try:
            await self._call(lambda r: r.ping())
            return True
        except StoreUnavailable as exc:
            # Degraded from the first request on, not after a few more timeouts.
            self.breaker.failure(f"start-up: {exc}", fatal=True)
            self._ensure_probe()
            return False

    def _ensure_probe(self) -> None:
        if not self._closed and (self._probe is None or self._probe.done()):
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="kvgate-sc-probe")

    async def _probe_loop(self) -> None:
        while self.breaker.is_open and not self._closed:
            await asyncio.sleep(self._probe_interval)
            try:
                await self._r.ping()
            except (*_UNAVAILABLE, RedisError) as exc:
                self.breaker.last_error = repr(exc)
                continue
            # The sync loop sees ``healthy`` again and resynchronises (events were missed).
            self.breaker.reset()

    # ---- entries ----

    async def get(self, entry_id: str, namespace: str) -> Entry | None:
        raw = await self._reads.submit((entry_id, namespace))
        if not raw:
            return None
        entry = decode_entry(entry_id, raw, self._embedder)
        if entry is None or entry.namespace != namespace or entry.expires_at <= time.time():
            return None
        return entry

    async def put(self, entry: Entry, cap: int) -> list[str]:
        fields = encode_entry(entry, self._embedder)
        flat = [x for pair in fields.items() for x in pair]
        keys = [self._k("e:", entry.id), self._k("ns:", entry.namespace), self._k("namespaces"), self._k("log")]
        args = [int(entry.expires_at) + 1, repr(time.time()), entry.id, entry.namespace, self._me, self._maxlen,
                cap, self._k("e:"), *flat]
        victims = await self._writes.submit((_PUT, keys, args))
        return [v.decode() if isinstance(v, bytes) else str(v) for v in victims]

    async def set_vector(self, entry: Entry) -> bool:
        if entry.vector is None:
            return False
        vec = np.ascontiguousarray(entry.vector, dtype=np.float32).tobytes()
        done = await self._writes.submit((_SET_VECTOR, [self._k("e:", entry.id), self._k("log")],
                                          [repr(entry.created), self._embedder, vec, entry.id, self._me,
                                           self._maxlen]))
        return bool(done)

    async def _read_batch(self, batch: list[tuple[str, str]]) -> list[Any]:
        """Every read of a batch in one pipelined round trip, as the writes: concurrent
        lookups (eight clients asking at once) would otherwise each pay a round trip and a
        socket write on the event loop."""
        async def op(r: aioredis.Redis) -> Any:
            pipe = r.pipeline(transaction=False)
            now = time.time()
            for entry_id, namespace in batch:
                pipe.hgetall(self._k("e:", entry_id))
                # Touch recency in the same round trip; XX never resurrects a purged id.
                pipe.zadd(self._k("ns:", namespace), {entry_id: now}, xx=True)
            return await pipe.execute(raise_on_error=False)

        replies = await self._call(op)
        return [StoreUnavailable(repr(x)) if isinstance(x, Exception) else x for x in replies[0::2]]

    async def _write_batch(self, batch: list[_Eval]) -> list[Any]:
        """Every write of a batch in one pipelined round trip (no MULTI: each script is
        atomic by itself, and one failing must not undo the others)."""
        async def op(r: aioredis.Redis) -> Any:
            if len(batch) == 1:  # a lone write pays for no pipeline
                script, keys, args = batch[0]
                try:
                    return [await r.eval(script, len(keys), *keys, *args)]
                except ResponseError as exc:  # its script failed: its own error, as in a batch
                    return [exc]
            pipe = r.pipeline(transaction=False)
            for script, keys, args in batch:
                pipe.eval(script, len(keys), *keys, *args)
            return await pipe.execute(raise_on_error=False)

        replies = await self._call(op)
        return [StoreUnavailable(repr(x)) if isinstance(x, Exception) else x for x in replies]

    async def _delete(self, ids: list[str]) -> None:
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i:i + _CHUNK]

            async def op(r: aioredis.Redis, chunk: list[str] = chunk) -> Any:
                pipe = r.pipeline(transaction=False)
                pipe.delete(*[self._k("e:", x) for x in chunk])
                pipe.xadd(self._k("log"), {"op": "del", "id": " ".join(chunk), "src": self._me},
                          maxlen=self._maxlen, approximate=True)
                return await pipe.execute()

            await self._call(op)

    async def _namespaces(self, only: str | None) -> list[str]:
        if only is not None:
            return [only]
        members = await self._call(lambda r: r.smembers(self._k("namespaces")))
        return sorted(m.decode() for m in members)

    async def _ids(self, namespace: str) -> list[str]:
        members = await self._call(lambda r: r.zrange(self._k("ns:", namespace), 0, -1))
        return [m.decode() for m in members]

    async def purge(self, flt: PurgeFilter) -> list[str]:
        gone: list[str] = []
        now = time.time()
        for ns in await self._namespaces(flt.namespace):
            ids = await self._ids(ns)
            if flt.model is not None or flt.older_than_s is not None:
                ids = await self._matching(ids, ns, flt, now)
            await self._delete(ids)
            await self._drop_from_namespace(ns, ids)
            gone.extend(ids)
        return gone

    async def _drop_from_namespace(self, ns: str, ids: list[str]) -> None:
        nskey = self._k("ns:", ns)
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i:i + _CHUNK]
            await self._call(lambda r: r.zrem(nskey, *chunk))  # noqa: B023 (awaited now)
        if not await self._call(lambda r: r.zcard(nskey)):
            await self._call(lambda r: r.srem(self._k("namespaces"), ns))

    async def _matching(self, ids: list[str], ns: str, flt: PurgeFilter, now: float) -> list[str]:
        out = []
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i:i + _CHUNK]

            async def op(r: aioredis.Redis, chunk: list[str] = chunk) -> Any:
                pipe = r.pipeline(transaction=False)
                for x in chunk:
                    pipe.hmget(self._k("e:", x), "model", "created")
                return await pipe.execute()

            for entry_id, (model, created) in zip(chunk, await self._call(op)):
                if model is None:  # expired already: drop the stale id too
                    out.append(entry_id)
                elif flt.matches(ns, model.decode(), float(created), now):
                    out.append(entry_id)
        return out

    async def fetch(self, ids: list[str], namespaces: dict[str, str] | None = None) -> list[Entry]:
        """Entries by id; missing ones are skipped (and, when their namespace is
        given, removed from it: their hash expired)."""
        out: list[Entry] = []
        stale: dict[str, list[str]] = {}
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i:i + _CHUNK]

            async def op(r: aioredis.Redis, chunk: list[str] = chunk) -> Any:
                pipe = r.pipeline(transaction=False)
                for x in chunk:
                    pipe.hgetall(self._k("e:", x))
                return await pipe.execute()

            for entry_id, raw in zip(chunk, await self._call(op)):
                entry = decode_entry(entry_id, raw, self._embedder) if raw else None
                if entry is not None:
                    out.append(entry)
                elif namespaces and entry_id in namespaces:
                    stale.setdefault(namespaces[entry_id], []).append(entry_id)
        for ns, gone in stale.items():
            await self._drop_from_namespace(ns, gone)
        return out

    async def ids(self) -> dict[str, str]:
        """Every id with its namespace. Ids unused for a whole TTL have certainly
        expired (their score is their last use, never before creation): dropped first."""
        out: dict[str, str] = {}
        for ns in await self._namespaces(None):
            nskey, cutoff = self._k("ns:", ns), time.time() - self._ttl
            await self._call(lambda r: r.zremrangebyscore(nskey, "-inf", cutoff))  # noqa: B023 (awaited now)
            out.update(dict.fromkeys(await self._ids(ns), ns))
        return out

    # ---- change log ----

    async def generation(self) -> str:
        """The data set's token (``P generation``), set now if it has none.

        A Redis that restarts between two of our calls is reconnected by the client
        without an error (its pool checks a socket before reuse), so no call may see the
        outage; the log's tail then reads an empty new stream from an old position and
        the index keeps entries the restart lost. A new token says so."""
        key, token = self._k("generation"), secrets.token_hex(8)

        async def op(r: aioredis.Redis) -> Any:
            pipe = r.pipeline(transaction=False)
            pipe.set(key, token, nx=True)
            pipe.get(key)
            return await pipe.execute()

        _, value = await self._call(op)
        return value.decode() if value else token

    async def log_position(self) -> str:
        """The id of the newest log event ("0-0" when empty): tail from here."""
        last = await self._call(lambda r: r.xrevrange(self._k("log"), count=1))
        return last[0][0].decode() if last else "0-0"

    async def read_log(self, after: str) -> tuple[str, list[tuple[str, list[str], str]]]:
        """Block up to ``sync_block_ms`` for events after ``after``.

        Returns (new position, [(op, ids, writer instance id)])."""
        key = self._k("log")
        reply = await self._call(lambda r: r.xread({key: after}, count=1000, block=self._block_ms),
                                 client=self._tail)
        events: list[tuple[str, list[str], str]] = []
        for _, items in reply or []:
            for event_id, fields in items:
                after = event_id.decode()
                events.append((fields.get(b"op", b"").decode(), fields.get(b"id", b"").decode().split(),
                               fields.get(b"src", b"").decode()))
        return after, events

    async def aclose(self) -> None:
        self._closed = True
        await self._writes.aclose()
        await self._reads.aclose()
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.wait({self._probe}, timeout=2.0)
        for client in (self._r, self._tail):
            try:
                await client.aclose()
            except (*_UNAVAILABLE, RedisError):
                pass
