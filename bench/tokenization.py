"""What exact token ids cost per request: in process (routing.tokens) and from vLLM's render server.

    python -m bench.tokenization                    # 1K, 4K and 16K-token chats, both sources
    python -m bench.tokenization --sizes 4096 --requests 400
    python -m bench.tokenization --no-render        # in process only (no vLLM venv needed)
    python -m bench.tokenization --endpoints chat messages responses   # the same requests on each protocol

(Named ``tokenization``, not ``tokenize``: run as a file, a ``tokenize.py`` would
shadow the standard library module of that name.)

Each request is a chat: a support assistant's system prompt (bench.overhead's
prose) sized to the row's token count, one of ``--requests`` distinct user turns,
so every request is a new body, as in production. ``--endpoints`` sends the same
system prompt and user turn as a Messages body (``system`` + one user message) and
a Responses body (``instructions`` + ``input``) too, so the rows compare what the
conversion to vLLM's chat form (routing.vllm_chat) adds to the chat figure. Rows:

* ``in-process, shared``: ``HFTokenSource.prompt_ids`` awaited on an event loop,
  exactly as the gateway calls it (the thread hop included where it applies),
  every request with the same system prompt (its ids come from the segment
  cache after the first);
* ``in-process, new``: the same with a system prompt never seen before on each
  request (every segment tokenized: the cache's worst case);
* ``render server``: ``RenderTokenSource.prompt_ids`` against ``vllm launch
  render`` on loopback, one shared client (the gateway's path), sequential.

Then whether a prefix cache would pay: what the template render alone costs,
what tokenizing the whole rendered prompt costs, and what tokenizing only the
part after the shared system turn costs (what a cache of the system turn's
ids would leave to do). A cache saves at most the difference; it is worth
building only if that is a large part of the in-process figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.loadgen import percentile
from bench.overhead import system_prompt
from routing.render_tokens import RenderTokenSource
from routing.tokens import HFTokenSource
from vllm_sim.tokenizer_dir import build_tokenizer_dir

_QUESTIONS = ("Where is my order {i}?", "Can I return item {i} after thirty days?",
              "My invoice {i} shows the wrong address, please fix it.",
              "Do you ship parcel {i} to Norway, and how long does it take?")


def chats(source: HFTokenSource, tokens: int, n: int, *, shared: bool = True, tag: str = "") -> list[dict[str, Any]]:
    """``n`` chat bodies of about ``tokens`` tokens each, distinct user turns; one system prompt for
    all (``shared``) or each its own (a session line first, with ``tag``: nothing of it was seen before)."""
    words = max(20, round(tokens / 1.28))
    for _ in range(4):  # the prose's tokens per word drifts a little with length: correct twice or so
        system = system_prompt(words)
        got = len(source.ids("chat", {"messages": [{"role": "system", "content": system}]}) or [])
        if abs(got - tokens) < tokens * 0.02:
            break
        words = max(20, round(words * tokens / max(got, 1)))
    return [{"messages": [{"role": "system", "content": system if shared else f"{tag}Session {i}.\n{system}"},
                          {"role": "user", "content": _QUESTIONS[i % len(_QUESTIONS)].format(i=i)}]}
            for i in range(n)]


def _ms(samples: list[float]) -> tuple[float, float]:
    return percentile(samples, 50) * 1000, percentile(samples, 99) * 1000


def as_endpoint(endpoint: str, chat: dict[str, Any]) -> dict[str, Any]:
    """A bench chat body (system + one user turn) as the same request on ``endpoint``."""
    system, user = (m["content"] for m in chat["messages"])
    if endpoint == "messages":
        return {"max_tokens": 16, "system": system, "messages": [{"role": "user", "content": user}]}
    if endpoint == "responses":
        return {"instructions": system, "input": user}
    return chat


async def time_source(prompt_ids: Callable[[str, dict[str, Any]], Any], bodies: list[dict[str, Any]],
                      model: str | None = None, endpoint: str = "chat", raw: bool = False) -> list[float]:
    """Seconds per ``prompt_ids`` call; ``raw``: the bodies are already the endpoint's."""
    out = []
    for body in bodies:
        payload = body if raw else as_endpoint(endpoint, body)
        if model:
            payload = {"model": model, **payload}
        t0 = time.perf_counter()
        ids = await prompt_ids(endpoint, payload)
        out.append(time.perf_counter() - t0)
        if ids is None:
            raise RuntimeError("no ids: the source failed")
    return out


def agent_bodies(turns: int = 20, tools: int = 8, tag: str = "") -> dict[str, dict[str, Any]]:
    """An agent's request on each protocol: ``tools`` tools, ``turns`` rounds of a user turn, a tool
    call and its result (the shape the Messages and Responses conversions do the most work on)."""
    schema = {"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}
    names = [f"tool_{i}" for i in range(tools)]
    system = tag + system_prompt(200)
    msgs: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    for t in range(turns):
        name, call = names[t % tools], f"call_{t}"
        msgs += [{"role": "user", "content": f"Step {t}: look at file {t}."},
                 {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                                   {"type": "tool_use", "id": call, "name": name,
                                                    "input": {"path": f"src/{t}.py", "n": t}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                               "content": f"contents of {t}"}]}]
        items += [{"role": "user", "content": f"Step {t}: look at file {t}."},
                  {"type": "function_call", "call_id": call, "name": name,
                   "arguments": f'{{"path": "src/{t}.py", "n": {t}}}'},
                  {"type": "function_call_output", "call_id": call, "output": f"contents of {t}"}]
    chat: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for t in range(turns):
        name, call = names[t % tools], f"call_{t}"
        chat += [{"role": "user", "content": f"Step {t}: look at file {t}."},
                 {"role": "assistant", "content": "Looking.", "tool_calls": [
                     {"id": call, "type": "function",
                      "function": {"name": name, "arguments": f'{{"path": "src/{t}.py", "n": {t}}}'}}]},
                 {"role": "tool", "tool_call_id": call, "content": f"contents of {t}"}]
    return {
        "chat": {"tools": [{"type": "function", "function": {"name": n, "description": f"Tool {n}",
                                                             "parameters": schema}} for n in names],
                 "messages": chat},
        "messages": {"max_tokens": 64, "system": system, "messages": msgs,
                     "tools": [{"name": n, "description": f"Tool {n}", "input_schema": schema} for n in names]},
        "responses": {"instructions": system, "input": items,
                      "tools": [{"type": "function", "name": n, "description": f"Tool {n}", "parameters": schema}
                                for n in names]},
    }


def time_conversion(source: HFTokenSource, endpoint: str, body: dict[str, Any], n: int = 2000) -> float:
    """Median µs of turning ``body`` into the chat form vLLM renders (routing.vllm_chat; chat: the identity)."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        source._as_chat(endpoint, body)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def time_parts(source: HFTokenSource, bodies: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Render only, tokenize the whole rendered prompt, tokenize only what follows the system turn."""
    tok = source.tokenizer
    parts: dict[str, list[float]] = {"render": [], "tokenize all": [], "tokenize after system": []}
    for body in bodies:
        t0 = time.perf_counter()
        text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        t1 = time.perf_counter()
        tok(text, add_special_tokens=False)
        t2 = time.perf_counter()
        # The system turn ends at its first <|im_end|>: special tokens split the text, so
        # ids before and after it are independent and a cache of the first part is exact.
        cut = text.index("<|im_end|>") + len("<|im_end|>")
        t3 = time.perf_counter()
        tok(text[cut:], add_special_tokens=False)
        t4 = time.perf_counter()
        parts["render"].append(t1 - t0)
        parts["tokenize all"].append(t2 - t1)
        parts["tokenize after system"].append(t4 - t3)
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--requests", type=int, default=200, help="per size (16K rows take a quarter)")
    parser.add_argument("--no-render", action="store_true", help="skip the render-server rows")
    parser.add_argument("--endpoints", nargs="+", default=["chat"], choices=["chat", "messages", "responses"])
    parser.add_argument("--agent-rounds", type=int, default=40, help="rounds in the growing agent conversation")
    args = parser.parse_args(argv)

    model_dir = build_tokenizer_dir(Path(tempfile.mkdtemp(prefix="kvgate-bench-tok-")) / "model")
    source = HFTokenSource(model_dir)
    rows: list[tuple[str, str, int, int, float, float]] = []
    parts_rows: list[tuple[int, dict[str, float]]] = []
    counts = {size: args.requests if size <= 4096 else max(20, args.requests // 4) for size in args.sizes}
    cases = {size: chats(source, size, n) for size, n in counts.items()}
    # Per endpoint: one endpoint's pass leaves its system prompts in the segment cache.
    fresh = {(size, e): chats(source, size, n, shared=False, tag=e) for size, n in counts.items()
             for e in args.endpoints}
    actual = {size: len(source.ids("chat", bodies[0]) or []) for size, bodies in cases.items()}

    async def in_process() -> None:
        for size, bodies in cases.items():
            # Endpoints side by side per size, so each compares with chat under the same load.
            for endpoint in args.endpoints:
                await time_source(source.prompt_ids, bodies[:5], endpoint=endpoint)  # warm: thread, template
                p50, p99 = _ms(await time_source(source.prompt_ids, bodies, endpoint=endpoint))
                rows.append(("in-process, shared", endpoint, actual[size], len(bodies), p50, p99))
                p50, p99 = _ms(await time_source(source.prompt_ids, fresh[size, endpoint], endpoint=endpoint))
                rows.append(("in-process, new", endpoint, actual[size], len(bodies), p50, p99))
            parts = time_parts(source, bodies)
            parts_rows.append((actual[size], {k: statistics.median(v) * 1000 for k, v in parts.items()}))

    asyncio.run(in_process())
    agent_rows = []
    for endpoint in args.endpoints:
        # One conversation growing a round per request, as an agent sends it; its own system
        # prompt per endpoint, so no endpoint finds another's segments.
        growing = [agent_bodies(k, tag=f"{endpoint}: ")[endpoint] for k in range(1, args.agent_rounds + 1)]
        last = growing[-1]
        times = asyncio.run(time_source(source.prompt_ids, growing, endpoint=endpoint, raw=True))
        agent_rows.append((endpoint, len(source.ids(endpoint, last) or []), time_conversion(source, endpoint, last),
                           percentile(times[1:], 50) * 1000, percentile(times[1:], 99) * 1000))

    if not args.no_render:
        from bench.vllm_render import render_server, vllm_python

        if vllm_python() is None:
            print("render server rows skipped: no vLLM venv (run .ci/vllm_venv.sh)", file=sys.stderr)
        else:
            with render_server(model_dir, model="bench-model") as server:
                async def render() -> None:
                    client = RenderTokenSource(server.url, timeout_s=30)
                    try:
                        for size, bodies in cases.items():
                            for endpoint in args.endpoints:
                                await time_source(client.prompt_ids, bodies[:5], server.model, endpoint)
                                p50, p99 = _ms(await time_source(client.prompt_ids, bodies, server.model,
                                                                 endpoint))
                                rows.append(("render server", endpoint, actual[size], len(bodies), p50, p99))
                    finally:
                        await client.aclose()

                asyncio.run(render())

    print("\nExact token ids per request (sequential, one request at a time; tokens: the chat form's)\n")
    print(f"{'source':<20} {'endpoint':<10} {'tokens':>7} {'requests':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name, endpoint, tokens, n, p50, p99 in rows:
        print(f"{name:<20} {endpoint:<10} {tokens:>7} {n:>9} {p50:>8.3f} {p99:>8.3f}")
    print(f"\nAn agent's conversation in process: request k has k rounds (user turn, tool call, tool result; "
          f"8 tools), k = 1..{args.agent_rounds}; figures over k >= 2; tokens and conversion at the last\n")
    print(f"{'endpoint':<10} {'tokens':>7} {'to chat form us':>16} {'ids p50 ms':>11} {'ids p99 ms':>11}")
    for endpoint, tokens, convert_us, p50, p99 in agent_rows:
        print(f"{endpoint:<10} {tokens:>7} {convert_us:>16.1f} {p50:>11.3f} {p99:>11.3f}")
    print("\nWhere the uncached in-process time goes (medians, ms): what a cache of the system turn's ids saves\n")
    print(f"{'tokens':>7} {'render':>8} {'tok all':>8} {'tok after system':>17} {'most a cache saves':>19}")
    for tokens, p in parts_rows:
        saved = p["tokenize all"] - p["tokenize after system"]
        print(f"{tokens:>7} {p['render']:>8.3f} {p['tokenize all']:>8.3f} {p['tokenize after system']:>17.3f} "
              f"{saved:>19.3f}")
    print(f"\nmachine: load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"a 1M-iteration Python loop takes {_loop_ms():.0f} ms here")
    return 0


def _loop_ms() -> float:
    """A yardstick printed with the figures: how loaded the cores were while they were taken."""
    t0 = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i
    return (time.perf_counter() - t0) * 1000


if __name__ == "__main__":
    raise SystemExit(main())
