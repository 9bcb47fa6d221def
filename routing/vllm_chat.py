"""The chat request vLLM builds from a Messages or a Responses body, so both tokenize as chat does.

vLLM 0.33 serves ``/v1/messages`` and ``/v1/responses`` by converting the body
into chat messages and tools and rendering those through the chat template
(``entrypoints/anthropic/serving.py::to_chat_completion_request``;
``renderers/online_renderer.py::render_responses`` with
``entrypoints/openai/responses/utils.py``). This module is that conversion,
on the raw JSON, so ``routing.tokens`` can feed its output to the same chat
path as a chat request and get the same ids vLLM prefills.

It also gives the tool list exactly as vLLM hands it to a template: each tool
through vLLM's pydantic model and ``model_dump()``, which fixes the key order,
drops unknown keys and writes ``description``/``parameters`` as null when a
client left them out. A template that prints ``tool | tojson`` (Hermes, Qwen)
sees those bytes, so the client's own dict would tokenize differently.

Whatever the conversion does not reproduce exactly raises ``Unrenderable``,
and that request routes approximately: images and documents, tool changes
inside messages, a ``tool_use`` without an id (vLLM makes one from the clock),
encrypted reasoning, ``previous_response_id`` (the history lives on the
replica) and ``truncation: auto`` (it depends on the replica's context length).
Pure functions over JSON: the input is never mutated.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Unrenderable", "chat_tools", "messages_as_chat", "responses_as_chat", "needs_system_first",
           "DISABLED_THINKING_PROBE", "EFFORTS"]


class Unrenderable(Exception):
    """The request holds something kvgate cannot turn into vLLM's exact ids."""


_BILLING_HEADER = "x-anthropic-billing-header"
# vLLM's probe for what Anthropic's thinking.type "disabled" becomes (DisabledThinkingEffortResolver):
# the chat prompt for this message under reasoning_effort "none" and under each effort.
DISABLED_THINKING_PROBE = [{"role": "user", "content": "Hi"}]
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _function(fn: Any) -> dict[str, Any]:
    """``FunctionDefinition.model_dump()``: these keys in this order, strict and defer_loading only when set."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise Unrenderable("tool")  # vLLM answers 400
    description, parameters = fn.get("description"), fn.get("parameters")
    if not (description is None or isinstance(description, str)) or not (
            parameters is None or isinstance(parameters, dict)):
        raise Unrenderable("tool")
    out: dict[str, Any] = {"name": fn["name"], "description": description, "parameters": parameters}
    for flag in ("strict", "defer_loading"):
        value = fn.get(flag)
        if value is not None:
            if not isinstance(value, bool):
                raise Unrenderable("tool")  # pydantic would coerce some values: not worth guessing
            out[flag] = value
    return out


def _objects(tools: Any) -> list[dict[str, Any]]:
    """A request's ``tools``: a list of objects, as vLLM's request models demand of every endpoint."""
    if not isinstance(tools, list):
        raise Unrenderable("tools")
    if not all(isinstance(tool, dict) for tool in tools):
        raise Unrenderable("tool")
    return tools


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A chat request's tools as vLLM gives them to the template (``ChatCompletionToolsParam.model_dump()``)."""
    if tools is None:
        return None
    out = []
    for tool in _objects(tools):
        if tool.get("type", "function") != "function":
            raise Unrenderable("tool")
        fn = tool.get("function")
        defer = tool.get("defer_loading")
        if defer is not None and isinstance(fn, dict) and fn.get("defer_loading") is None:
            fn = {**fn, "defer_loading": defer}  # vLLM copies it down (_propagate_defer_loading)
        row: dict[str, Any] = {"type": "function", "function": _function(fn)}
        if defer is not None:
            if not isinstance(defer, bool):
                raise Unrenderable("tool")
            row["defer_loading"] = defer
        out.append(row)
    return out or None


def needs_system_first(template: str | None) -> bool:
    """vLLM's test for merging inline system messages into the first (``_detect_merge_inline_system``).

    It renders [system, user, system, user] with its own sandboxed environment;
    a template that raises (Qwen's ``loop.first`` guard) gets every system text
    merged into the leading one. Reproduced with the same environment and
    arguments, so a template that fails only there fails here too."""
    if not template:
        return True
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    try:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.from_string(template).render(
            messages=[{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                      {"role": "system", "content": "t"}, {"role": "user", "content": "t"}],
            add_generation_prompt=False)
        return False
    except jinja2.TemplateError:
        return True


# ---- Anthropic Messages (AnthropicServingMessages.to_chat_completion_request) ----

_BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                          "redacted_thinking", "tool_addition", "tool_removal"})


def _blocks(content: Any) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise Unrenderable("content blocks")
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in _BLOCK_TYPES:
            raise Unrenderable("content blocks")  # AnthropicContentBlock would not validate: a 400
        if kind == "tool_addition" or kind == "tool_removal":
            raise Unrenderable("tool changes")  # vLLM folds them into the tool list (_resolve_tools)
    return content


def _system_text(content: Any) -> str | None:
    """``_extract_system_text``: the text blocks joined with nothing between, billing header blocks dropped."""
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    parts = [b["text"] for b in _blocks(content) if b["type"] == "text" and isinstance(b.get("text"), str)
             and b["text"] and not b["text"].startswith(_BILLING_HEADER)]
    return "".join(parts) if parts else None


def _user_tool_result(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind in ("image", "tool_reference"):
                # An image becomes a user turn of its own, a reference a structured tool turn.
                raise Unrenderable("tool result " + kind)
        text = "\n".join(texts)
    elif content is not None:
        raise Unrenderable("tool result content")
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text or ""}


def _anthropic_message(msg: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """One message onto ``out`` (``_convert_messages`` for a user or assistant turn)."""
    role, content = msg["role"], msg.get("content")
    m: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        m["content"] = content
        out.append(m)
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in _blocks(content):
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            raise Unrenderable("image")
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            if block.get("input") is not None and not isinstance(block["input"], dict):
                raise Unrenderable("tool_use input")  # AnthropicContentBlock would not validate
            if not block.get("id"):
                raise Unrenderable("tool_use without id")  # vLLM names it call_<unix time>
            # vLLM writes json.dumps(input) and parses it back for the template: the same
            # object, so it is passed as is (the chat path takes objects).
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block.get("name") or "", "arguments": block.get("input") or {}}})
        elif kind == "tool_result":
            if role == "user":
                out.append(_user_tool_result(block))  # before the turn it came in, as vLLM orders it
            else:
                result = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {str(result) if result else ''}"})
    if reasoning:
        m["reasoning"] = "".join(reasoning)
    if calls:
        m["tool_calls"] = calls
    if parts:
        m["content"] = parts[0]["text"] if len(parts) == 1 else parts
    if not (role == "user" and "content" not in m):
        out.append(m)


def _anthropic_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for tool in _objects(tools):
        if not isinstance(tool.get("input_schema"), dict):
            raise Unrenderable("tool")
        schema = tool["input_schema"]
        if "type" not in schema:
            schema = {**schema, "type": "object"}  # AnthropicTool's validator adds it, last
        out.append({"type": "function", "function": _function({
            "name": tool.get("name"), "description": tool.get("description"), "parameters": schema,
            "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading")})})
    return out


def messages_as_chat(body: dict[str, Any], *, merge_inline_system: bool,
                     disabled_thinking_effort: str) -> dict[str, Any]:
    """The chat body vLLM renders for an Anthropic Messages body.

    ``merge_inline_system`` is ``needs_system_first`` of the model's template;
    ``disabled_thinking_effort`` what vLLM's probe resolved ``thinking.type:
    disabled`` to for it (``"none"`` or ``"low"``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
            and isinstance(m.get("content"), (str, list)) for m in messages):
        raise Unrenderable("messages")
    system: list[str] = []
    top = body.get("system")
    if isinstance(top, str):
        if top:
            system.append(top)
    elif isinstance(top, list):
        for block in _blocks(top):
            text = block.get("text")
            if block["type"] == "text" and isinstance(text, str) and text and not text.startswith(_BILLING_HEADER):
                system.append(text)
    elif top is not None:
        raise Unrenderable("system")
    out: list[dict[str, Any]] = []
    if merge_inline_system:
        system += [t for m in messages if m["role"] == "system" and (t := _system_text(m["content"]))]
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for msg in messages:
        if msg["role"] == "system":
            text = None if merge_inline_system else _system_text(msg["content"])
            if text:
                out.append({"role": "system", "content": text})
            continue
        _anthropic_message(msg, out)
    chat: dict[str, Any] = {"messages": out}
    tools = _anthropic_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    effort = None
    config = body.get("output_config")
    if isinstance(config, dict) and config.get("effort") is not None:
        effort = config["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = disabled_thinking_effort  # after output_config, as vLLM applies them
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


# ---- OpenAI Responses (construct_input_messages, construct_tool_dicts) ----

def _response_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``construct_tool_dicts``: the function tools the model is shown, as chat tools; other kinds dropped."""
    if not tools:
        return None
    out = []
    for tool in _objects(tools):
        kind = tool.get("type")
        if kind == "function":
            fns = [tool]
        elif kind == "namespace":  # its functions, flattened to <namespace>__<name>
            members = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(members, list):
                raise Unrenderable("namespace tool")
            fns = [{**t, "name": f"{tool['name']}__{t.get('name')}"} for t in members
                   if isinstance(t, dict) and t.get("type") == "function"]
        elif kind == "custom":  # a single-string function shim (custom_tool_as_function_dict)
            fns = [{"name": tool.get("name"), "description": tool.get("description"),
                    "parameters": _CUSTOM_PARAMETERS}]
        else:
            continue  # web search, MCP, file search, ...: never rendered for the model
        out += [{"type": "function", "function": _function(fn)} for fn in fns]
    return out or None


_CUSTOM_INPUT_KEY = "input"
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {_CUSTOM_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": [_CUSTOM_INPUT_KEY],
    "additionalProperties": False,
}
_ROLES = ("user", "assistant", "system", "developer")


def _call(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "custom_tool_call":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
            raise Unrenderable("custom_tool_call")
        name = item["name"]
        # vLLM's shim writes {"input": ...} as JSON, which the template gets parsed back.
        arguments: Any = {_CUSTOM_INPUT_KEY: item.get("input") or ""}
    else:
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise Unrenderable("function_call")  # ResponseFunctionToolCall would not validate
        name = item["name"]
        if item.get("namespace"):
            name = f"{item['namespace']}__{name}"
        arguments = item["arguments"]
    return {"id": item["call_id"], "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(item: dict[str, Any]) -> str:
    summary, content = item.get("summary"), item.get("content")
    if not isinstance(summary, list) or not all(isinstance(s, dict) and isinstance(s.get("text"), str)
                                                for s in summary):
        raise Unrenderable("reasoning")  # ResponseReasoningItem requires the summary
    if item.get("encrypted_content"):
        raise Unrenderable("encrypted reasoning")  # vLLM refuses it
    if content:
        if not isinstance(content, list) or not all(isinstance(c, dict) and isinstance(c.get("text"), str)
                                                    for c in content):
            raise Unrenderable("reasoning content")
        return content[0]["text"]  # type: ignore[no-any-return]
    return summary[0]["text"] if summary else ""


def _assistant_text(item: dict[str, Any]) -> str | None:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Unrenderable("assistant content")
    if not content:
        return None
    first = content[0]
    if not isinstance(first, dict):
        raise Unrenderable("assistant content")
    if item.get("type") == "message" and first.get("type") != "output_text":
        raise Unrenderable("assistant content")  # a refusal, or a part ResponseOutputMessage rejects
    text = first.get("text")
    if text is not None and not isinstance(text, str):
        raise Unrenderable("assistant content")
    return text  # vLLM keeps the first part only


def _input_item(item: Any, out: list[dict[str, Any]]) -> None:
    """One input item onto ``out`` (``_construct_message_from_response_item``)."""
    if not isinstance(item, dict):
        raise Unrenderable("input item")
    kind = item.get("type")
    prev = out[-1] if out and out[-1].get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        call = _call(item)
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "tool_calls": [call]})
        return
    if kind == "reasoning":
        text = _reasoning(item)
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            out.append({"role": "assistant", "reasoning": text})
        return
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        if not (output is None or isinstance(output, (str, list))):
            raise Unrenderable("tool output")
        out.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
        return
    role = item.get("role")
    if kind not in (None, "message") or role not in _ROLES:
        raise Unrenderable("input item")  # a kind vLLM does not take on this path: a 400 there
    content = item.get("content")
    if not isinstance(content, (str, list)):
        raise Unrenderable("message content")
    if role == "assistant":
        said = _assistant_text(item)
        if said is not None:
            if prev is not None and prev.get("content") is None:
                prev["content"] = said
            else:
                out.append({"role": "assistant", "content": said})
            return
    # Validated as an input-message TypedDict: only role and content reach the template.
    out.append({"role": role, "content": content})


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body vLLM renders for a Responses body (without ``previous_response_id``)."""
    if body.get("previous_response_id") is not None:
        raise Unrenderable("previous_response_id")  # the earlier turns are on the replica
    if body.get("prompt") is not None:
        raise Unrenderable("prompt")  # vLLM refuses prompt templates
    if body.get("truncation") not in (None, "disabled"):
        raise Unrenderable("truncation")  # to the replica's max_model_len - max_output_tokens
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise Unrenderable("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _input_item(item, messages)
    else:
        raise Unrenderable("input")
    # A last assistant message (or reasoning) marked unfinished is continued, not answered
    # (should_continue_final_message).
    last = given[-1] if isinstance(given, list) and given else None
    continue_final = isinstance(last, dict) and last.get("type", "message") in ("message", "reasoning") \
        and last.get("status") in ("in_progress", "incomplete")
    # Unlike chat, vLLM tokenizes a Responses prompt with the tokenizer's special tokens
    # (ResponsesRequest.build_tok_params leaves TokenizeParams' add_special_tokens=True):
    # a BOS before the template's text, a second one if the template writes its own.
    chat: dict[str, Any] = {"messages": messages, "add_generation_prompt": not continue_final,
                            "continue_final_message": continue_final, "add_special_tokens": True}
    tools = _response_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat
