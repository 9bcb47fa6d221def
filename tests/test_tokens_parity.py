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

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routing.render_tokens import RenderTokenSource
from routing.tokens import HFTokenSource
from tests.support.protocol_bodies import MESSAGES, RESPONSES, UNRENDERABLE
from tests.support.vllm_env import RenderServer, VllmWorker

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
    # vLLM hands the template its own dump of each tool: fixed key order, unknown keys
    # dropped, a missing description as null, defer_loading copied into the function.
    "tools_as_vllm_dumps_them": {"tool_choice": "none", "tools": [
        {"function": {"parameters": {"type": "object"}, "name": "ping", "x-extra": 1}, "type": "function"},
        {"type": "function", "function": {"name": "later", "description": "d"}, "defer_loading": True}],
        "messages": [{"role": "user", "content": "x"}]},
    "add_special_tokens": {"add_special_tokens": True, "messages": [{"role": "user", "content": "x"}]},
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
def tokdir(vllm_tokdir: Path) -> Path:
    return vllm_tokdir


@pytest.fixture(scope="module")
def server(vllm_render: RenderServer) -> RenderServer:
    return vllm_render


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


# ---- /v1/messages and /v1/responses: vLLM's conversion to chat, then the chat template ----

@pytest.mark.parametrize("case", sorted(MESSAGES))
def test_messages_ids_equal_vllm_render(server: RenderServer, source: HFTokenSource, case: str) -> None:
    body = MESSAGES[case]
    assert ours(source, "messages", body) == server.render("messages", body)


@pytest.mark.parametrize("case", sorted(RESPONSES))
def test_responses_ids_equal_vllm_render(server: RenderServer, source: HFTokenSource, case: str) -> None:
    body = RESPONSES[case]
    expected = server.render("responses", body)
    assert ours(source, "responses", body) == expected
    # vLLM 0.33 tokenizes a Responses prompt with the tokenizer's special tokens, unlike chat.
    assert expected[0] == source.tokenizer.convert_tokens_to_ids("[CLS]")


@pytest.mark.parametrize("case", sorted(UNRENDERABLE))
def test_what_kvgate_cannot_reproduce_routes_approximately(source: HFTokenSource, case: str) -> None:
    endpoint, body = UNRENDERABLE[case]
    assert ours(source, endpoint, body) is None


def test_long_messages_and_responses_from_the_segment_cache_equal_vllm_render(
        server: RenderServer, source: HFTokenSource) -> None:
    """A 4K-token system prompt shared by turns on both protocols: ids from the cache, still vLLM's."""
    assert source.cache is not None
    system = "Protocols. " + long_chat(4096)["messages"][0]["content"]  # not the chat tests' prompt: uncached
    hits, offloaded = source.cache.hits, source.offloaded
    for question in ("First?", "Second, with ünïcödé", "Third ☕"):
        messages = {"max_tokens": 8, "system": system, "messages": [{"role": "user", "content": question}]}
        assert ours(source, "messages", messages) == server.render("messages", messages)
        responses = {"instructions": system, "input": question}
        assert ours(source, "responses", responses) == server.render("responses", responses)
    assert source.cache.hits >= hits + 4, "the shared system prompt is tokenized once"
    assert source.offloaded > offloaded, "the first long prompt is tokenized off the event loop"


@pytest.mark.parametrize("endpoint", ["chat", "messages", "responses"])
def test_a_growing_agent_conversation_equals_vllm_render(server: RenderServer, source: HFTokenSource,
                                                         endpoint: str) -> None:
    """An agent's conversation growing a round (user turn, tool call, tool result) per request:
    after the first, its ids come mostly from cached runs of short turns, and stay vLLM's."""
    from bench.tokenization import agent_bodies

    assert source.cache is not None
    hits = source.cache.hits
    for rounds in range(1, 13):
        body = agent_bodies(rounds, tools=3, tag=f"parity {endpoint}: ")[endpoint]
        assert ours(source, endpoint, body) == server.render(endpoint, body), f"{rounds} rounds"
    assert source.cache.hits >= hits + 11


def test_the_render_client_asks_the_messages_and_responses_routes(server: RenderServer) -> None:
    async def run() -> tuple[list[int] | None, ...]:
        client = RenderTokenSource(server.url, timeout_s=30)
        try:
            messages = await client.prompt_ids("messages", {"model": server.model,
                                                            **MESSAGES["system_turns_tools_unicode"]})
            responses = await client.prompt_ids("responses", {"model": server.model,
                                                              **RESPONSES["instructions_items_tools"]})
            # The render server keeps no responses: not asked (no request, no failure).
            asked = client.requests
            stored = await client.prompt_ids("responses", {"model": server.model, "input": "x",
                                                           "previous_response_id": "resp_1"})
            return messages, responses, stored, asked, client.requests, client.failures
        finally:
            await client.aclose()

    messages, responses, stored, asked, requests, failures = asyncio.run(run())
    assert messages == server.render("messages", MESSAGES["system_turns_tools_unicode"])
    assert responses == server.render("responses", RESPONSES["instructions_items_tools"])
    assert stored is None and requests == asked == 2 and failures == 0


def _rendered_or_none(server: RenderServer, endpoint: str, body: dict[str, Any]) -> list[int] | None:
    """The server's ids, or None where it answers 400 (all text blocks empty: "an empty conversation")."""
    import httpx

    try:
        return server.render(endpoint, body)
    except httpx.HTTPStatusError as err:
        if err.response.status_code != 400:
            raise
        return None


_blocks = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), min_size=1, max_size=3)
_anthropic_turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                         "content": st.one_of(_text, _blocks)})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=st.one_of(st.none(), _text, _blocks), turns=st.lists(_anthropic_turn, min_size=1, max_size=4))
def test_any_text_messages_equal_vllm_render(server: RenderServer, source: HFTokenSource, system: Any,
                                             turns: list[dict[str, Any]]) -> None:
    body: dict[str, Any] = {"max_tokens": 8, "messages": turns}
    if system is not None:
        body["system"] = system
    assert ours(source, "messages", body) == _rendered_or_none(server, "messages", body)


_response_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": _text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("input_text"), "text": _text}), min_size=1, max_size=3)}),
    st.fixed_dictionaries({"type": st.just("message"), "role": st.just("assistant"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("output_text"), "text": _text}), min_size=1, max_size=2)}),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(instructions=st.one_of(st.none(), _text), items=st.lists(_response_item, min_size=1, max_size=4))
def test_any_text_responses_equal_vllm_render(server: RenderServer, source: HFTokenSource,
                                              instructions: str | None, items: list[dict[str, Any]]) -> None:
    body: dict[str, Any] = {"input": items}
    if instructions is not None:
        body["instructions"] = instructions
    assert ours(source, "responses", body) == _rendered_or_none(server, "responses", body)


def test_inline_system_merging_is_decided_as_vllm_decides_it(vllm_worker: VllmWorker) -> None:
    """``needs_system_first`` against vLLM's own ``_detect_merge_inline_system`` on templates that differ."""
    import json

    from routing.vllm_chat import needs_system_first

    templates = [
        Path(__file__).parents[1].joinpath("vllm_sim", "chatml.jinja").read_text(),
        # Qwen's guard: a system message anywhere but first raises.
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be first') }}{% endif %}{{ m.content }}{% endfor %}",
        "{{ messages[0].content }}{{ strftime_now('%Y') }}",  # a helper vLLM's probe does not define
        "{% for m in messages %}{{ m.role }}{% endfor %}{{ bos_token }}",
        "",
    ]
    code = ("import json, sys\n"
            "from vllm.entrypoints.anthropic.serving import AnthropicServingMessages as A\n"
            "print(json.dumps([A._detect_merge_inline_system(t or None) for t in json.loads(sys.stdin.read())]))")
    out = vllm_worker.run(code, input=json.dumps(templates))
    assert out.returncode == 0, out.stderr[-3000:]
    expected = json.loads(out.stdout.strip().splitlines()[-1])
    assert [needs_system_first(t or None) for t in templates] == expected
    assert expected[:2] == [False, True], "both answers occur"


# The simulator renders what kvgate's benchmarks send; developer-role folding and
# prompt truncation are the gateway's concern, not the fake's.
# Nor does it redo vLLM's tool dump or a chat request's add_special_tokens (benchmarks send neither).
SIM_SKIPS = {"developer_role", "truncated_chat", "truncated", "truncated_left", "truncated_right", "truncated_ids",
             "tools_as_vllm_dumps_them", "add_special_tokens"}


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


def test_kvgate_check_compares_token_ids_as_vllms_own_tokenize_gives_them(server: RenderServer,
                                                                          source: HFTokenSource) -> None:
    """``kvgate check``'s token-id check asks a replica's /tokenize for its probe chat: vLLM's own
    route gives exactly the ids kvgate computes, so the check passes where they agree."""
    from gateway.server.check import add_tokens

    results: list[tuple[Any, ...]] = []
    with httpx.Client(timeout=60) as client:
        add_tokens(lambda *a: results.append(a), server.model, client, server.url, {}, lambda _m: source)
    ((name, status, detail),) = results
    assert (name, status) == (f"token ids {server.model}", "ok"), detail
