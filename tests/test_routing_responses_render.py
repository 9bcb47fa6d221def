"""The Responses rendering follows the chat stream's rules, so its stable head is a shared prefix."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from routing.hashing import render
from routing.boundary import default_cap

TOOLS = [{"type": "function", "name": "read_file", "parameters": {"type": "object"}}]
text = st.text(max_size=200)


@given(text, text)
def test_same_stream_as_the_equivalent_chat(instructions: str, user: str) -> None:
    responses = render("responses", {"tools": TOOLS, "instructions": instructions, "input": user})
    chat = render("chat", {"tools": TOOLS, "messages": [{"role": "system", "content": instructions},
                                                        {"role": "user", "content": user}]})
    assert responses.data == chat.data
    assert [s.role for s in responses.spans] == ["tools", "system", "user"]


@given(text, text, text)
def test_instructions_and_tools_are_the_shared_head(instructions: str, a: str, b: str) -> None:
    ra = render("responses", {"tools": TOOLS, "instructions": instructions, "input": a})
    rb = render("responses", {"tools": TOOLS, "instructions": instructions,
                              "input": [{"role": "user", "content": [{"type": "input_text", "text": b}]}]})
    head = ra.spans[1].end
    assert ra.data[:head] == rb.data[:head]
    assert default_cap(ra)[1] == ra.spans[2].end  # the first user turn caps the stable prefix


def test_item_ids_and_status_do_not_change_the_stream() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"}
    a = render("responses", {"input": [{"role": "user", "content": "go"}, call]})
    b = render("responses", {"input": [{"role": "user", "content": "go"}, {**call, "id": "fc_9", "status": "done"}]})
    assert a.data == b.data
    c = render("responses", {"input": [{"role": "user", "content": "go"}, {**call, "arguments": '{"x":1}'}]})
    assert c.data != a.data


def test_previous_response_opens_a_span_after_the_head() -> None:
    base = {"tools": TOOLS, "instructions": "be terse", "input": "next"}
    plain, cont = render("responses", base), render("responses", {**base, "previous_response_id": "resp_kg1.x"})
    assert [s.role for s in cont.spans] == ["tools", "system", "previous_response", "user"]
    head = plain.spans[1].end
    assert cont.data[:head] == plain.data[:head] and cont.data != plain.data
