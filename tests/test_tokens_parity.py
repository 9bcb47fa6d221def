"""kvgate's token ids equal vLLM's own, byte for byte (issue 16, item 5).

vLLM 0.33.0's render server (``vllm launch render``: its real chat-template
and tokenization code, no weights) runs on the tokenizer directory built from
the MiniLM package; kvgate's in-process source (``HFTokenSource``) and its
render-server client must produce the ids the server returns. Skipped, with
the reason, where the vLLM venv is missing (CI installs it: .ci/vllm_venv.sh).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routing.render_tokens import RenderTokenSource
from routing.tokens import HFTokenSource
from tests.support.vllm_env import RenderServer, need_vllm, render_server
from vllm_sim.tokenizer_dir import build_tokenizer_dir

pytestmark = pytest.mark.timeout(300)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city; °C by default.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]

CHATS: dict[str, dict[str, Any]] = {
    "system_and_user": {"messages": [{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": "Name three primes."}]},
    "several_roles": {"messages": [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "What is KV caching?", "name": "alice"},
        {"role": "assistant", "content": "Reusing attention keys and values of a shared prefix."},
        {"role": "user", "content": "And prefix-aware routing?"}]},
    "unicode": {"messages": [{"role": "user", "content":
                              "Café, naïve, Straße, Ελληνικά, русский, 日本語, 中文, 한국어, 🙂🚀 ﷺ\u200b!"}]},
    "multi_part_content": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "text", "text": "two parts"}]}]},
    "tools": {"tools": TOOLS, "tool_choice": "auto", "messages": [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "22 C, clear"}]},
        {"role": "user", "content": "Thanks!"}]},
    "tools_without_system": {"tools": TOOLS, "tool_choice": "none",
                             "messages": [{"role": "user", "content": "Search for vLLM."}]},
    "bad_tool_arguments": {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "search", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]},
    "developer_role": {"messages": [{"role": "developer", "content": "Be formal."},
                                    {"role": "user", "content": "hello"},
                                    {"role": "developer", "content": "Be brief."}]},
    "no_generation_prompt": {"add_generation_prompt": False,
                             "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    "continue_final_message": {"add_generation_prompt": False, "continue_final_message": True,
                               "messages": [{"role": "user", "content": "Count:"},
                                            {"role": "assistant", "content": "1, 2,"}]},
    "empty_and_missing_content": {"messages": [{"role": "user", "content": ""},
                                               {"role": "assistant", "content": None},
                                               {"role": "user", "content": "again"}]},
    "truncated_chat": {"truncate_prompt_tokens": 5, "messages": [{"role": "user", "content": "a b c d e f g"}]},
    "reasoning_effort": {"reasoning_effort": "low", "messages": [{"role": "user", "content": "think"}]},
    "unknown_fields_and_kwargs": {"chat_template_kwargs": {"enable_thinking": False},
                                  "messages": [{"role": "user", "content": "x", "metadata": {"a": 1}}]},
}

COMPLETIONS: dict[str, dict[str, Any]] = {
    "text": {"prompt": "The capital of France is"},
    "no_special_tokens": {"prompt": "The capital of France is", "add_special_tokens": False},
    "token_ids": {"prompt": [101, 7592, 2088, 30522, 5]},
    "unicode": {"prompt": "Grüße aus Köln — 東京から 👋"},
    "truncated": {"prompt": "one two three four five six seven eight", "truncate_prompt_tokens": 4},
    "truncated_left": {"prompt": "one two three four five six seven eight", "truncate_prompt_tokens": 4,
                       "truncation_side": "left"},
    "truncated_right": {"prompt": "one two three four five six seven eight", "truncate_prompt_tokens": 4,
                        "truncation_side": "right"},
    "truncated_ids": {"prompt": [101, 7592, 2088, 30522, 5], "truncate_prompt_tokens": 2},
}


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_vllm()
    return build_tokenizer_dir(tmp_path_factory.mktemp("parity") / "model")


@pytest.fixture(scope="module")
def server(tokdir: Path) -> Iterator[RenderServer]:
    with render_server(tokdir) as srv:
        yield srv


@pytest.fixture(scope="module")
def source(tokdir: Path) -> HFTokenSource:
    return HFTokenSource(tokdir)


def ours(source: HFTokenSource, endpoint: str, body: dict[str, Any]) -> list[int] | None:
    return asyncio.run(source.prompt_ids(endpoint, body))


def long_chat(tokens: int) -> dict[str, Any]:
    """A chat of about ``tokens`` tokens: a long system prompt, a few turns."""
    words = ("routing", "prefix", "cache", "replica", "tenant", "block", "token", "gateway", "événement", "路由")
    # About 2.5 tokens a word here (word, number, the odd accent or CJK piece).
    system = " ".join(f"{words[i % len(words)]}{i % 97}" for i in range(int(tokens * 0.4)))
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Summarise the above."},
                         {"role": "assistant", "content": "It is about routing."},
                         {"role": "user", "content": "More detail, please."}]}


@pytest.mark.parametrize("case", sorted(CHATS))
def test_chat_ids_equal_vllm_render(server: RenderServer, source: HFTokenSource, case: str) -> None:
    body = CHATS[case]
    expected = server.render("chat", body)
    assert ours(source, "chat", body) == expected


@pytest.mark.parametrize("case", sorted(COMPLETIONS))
def test_completion_ids_equal_vllm_render(server: RenderServer, source: HFTokenSource, case: str) -> None:
    body = COMPLETIONS[case]
    assert ours(source, "completions", body) == server.render("completions", body)


def test_a_4k_token_chat_equals_vllm_render(server: RenderServer, source: HFTokenSource) -> None:
    body = long_chat(4096)
    expected = server.render("chat", body)
    assert 3500 < len(expected) < 6000
    assert ours(source, "chat", body) == expected
    assert source.offloaded >= 1, "a prompt this long is tokenized off the event loop"


def test_ids_from_the_segment_cache_equal_vllm_render(server: RenderServer, source: HFTokenSource) -> None:
    """Requests sharing a long system prompt take its ids from the cache: still vLLM's ids."""
    assert source.cache is not None
    system = long_chat(2048)["messages"][0]["content"]
    hits = source.cache.hits
    for question in ("First question?", "Second question, with tools.", "Third: ünïcödé"):
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        assert ours(source, "chat", body) == server.render("chat", body)
    assert source.cache.hits >= hits + 2


def test_the_render_client_returns_the_servers_ids(server: RenderServer) -> None:
    async def run() -> tuple[list[int] | None, list[int] | None, list[int] | None]:
        client = RenderTokenSource(server.url, timeout_s=30)
        try:
            chat = await client.prompt_ids("chat", {"model": server.model, **CHATS["tools"]})
            comp = await client.prompt_ids("completions", {"model": server.model, **COMPLETIONS["text"]})
            # A model the server does not serve: a 404 there, no ids here, no exception.
            other = await client.prompt_ids("chat", {"model": "not-served", **CHATS["unicode"]})
            return chat, comp, other
        finally:
            await client.aclose()

    chat, comp, other = asyncio.run(run())
    assert chat == server.render("chat", CHATS["tools"])
    assert comp == server.render("completions", COMPLETIONS["text"])
    assert other is None


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": _text})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(_message, min_size=1, max_size=5))
def test_any_text_chat_equals_vllm_render(server: RenderServer, source: HFTokenSource,
                                          messages: list[dict[str, Any]]) -> None:
    body = {"messages": messages}
    assert ours(source, "chat", body) == server.render("chat", body)


# The simulator renders what kvgate's benchmarks send; developer-role folding and
# prompt truncation are the gateway's concern, not the fake's.
SIM_SKIPS = {"developer_role", "truncated_chat", "truncated", "truncated_left", "truncated_right", "truncated_ids"}


@pytest.fixture(scope="module")
def sim(tokdir: Path) -> Iterator[str]:
    from tests.support.servers import ServerThread
    from vllm_sim.config import SimConfig
    from vllm_sim.server import build_app

    server = ServerThread(build_app(SimConfig(name="sim-tok", tokenizer=str(tokdir)))).start()
    try:
        yield server.url
    finally:
        server.stop()


def _sim_ids(sim: str, body: dict[str, Any]) -> list[int]:
    import httpx

    r = httpx.post(sim + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", sorted(set(CHATS) - SIM_SKIPS))
def test_simulator_chat_ids_equal_vllm_render(server: RenderServer, sim: str, case: str) -> None:
    assert _sim_ids(sim, CHATS[case]) == server.render("chat", CHATS[case])


@pytest.mark.parametrize("case", sorted(set(COMPLETIONS) - SIM_SKIPS))
def test_simulator_completion_ids_equal_vllm_render(server: RenderServer, sim: str, case: str) -> None:
    assert _sim_ids(sim, COMPLETIONS[case]) == server.render("completions", COMPLETIONS[case])


def test_simulator_prefills_the_rendered_ids(server: RenderServer, sim: str) -> None:
    """A generation request is charged for exactly vLLM's prompt: usage.prompt_tokens matches."""
    import httpx

    body = long_chat(4096)
    r = httpx.post(sim + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(server.render("chat", body))
