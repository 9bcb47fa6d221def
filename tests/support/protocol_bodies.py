"""Messages and Responses bodies for the token parity tests: each renders through vLLM's own conversion.

Every case is one vLLM 0.33 accepts and kvgate reproduces in process
(``routing.vllm_chat``); ``UNRENDERABLE`` are the ones kvgate routes
approximately, with why.
"""

from __future__ import annotations

from typing import Any

ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city; °C by default.",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    # No description and no "type" in the schema: vLLM writes null and appends "type": "object".
    {"name": "search", "input_schema": {"properties": {"q": {"type": "string"}}}},
    {"name": "strict_one", "description": "d", "input_schema": {"type": "object"}, "strict": True,
     "defer_loading": False},
]

RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Current weather for a city; °C by default.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
     "strict": False},
    {"type": "function", "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    {"type": "custom", "name": "apply_patch", "description": "Apply a unified diff"},
    {"type": "namespace", "name": "fs", "description": "files",
     "tools": [{"type": "function", "name": "read", "description": "Read a file", "parameters": {"type": "object"}}]},
    {"type": "web_search"},  # not a function: vLLM shows it to no template
]

M: dict[str, Any] = {"max_tokens": 16}

MESSAGES: dict[str, dict[str, Any]] = {
    "system_turns_tools_unicode": {**M, "tools": ANTHROPIC_TOOLS, "system": [
        {"type": "text", "text": "You are a weather assistant. Réponds brièvement 🙂"},
        {"type": "text", "text": " Use tools when needed.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Wetter in Köln und 東京?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two cities: two calls.", "signature": "sig"},
                {"type": "text", "text": "Checking both."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Köln"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "東京", "n": [1, 2]}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 °C, cloudy"},
                {"type": "tool_result", "tool_use_id": "toolu_2",
                 "content": [{"type": "text", "text": "22 °C"}, {"type": "text", "text": "clear"}]},
                {"type": "text", "text": "Thanks! Any rain? ☔"}]},
            {"role": "assistant", "content": "Not today."},
            {"role": "user", "content": [{"type": "text", "text": "Sure?"}, {"type": "text", "text": "Double-check."}]},
        ]},
    "system_string": {**M, "system": "Be terse.", "messages": [{"role": "user", "content": "hi"}]},
    "billing_header_dropped": {**M, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9f8e7d"},
        {"type": "text", "text": "You are Claude Code."}], "messages": [{"role": "user", "content": "ls"}]},
    "inline_system_reminder": {**M, "system": "Top.", "messages": [
        {"role": "user", "content": "a"}, {"role": "system", "content": "Reminder: be careful."},
        {"role": "user", "content": "b"}]},
    "tool_choice_none": {**M, "tools": ANTHROPIC_TOOLS[:1], "tool_choice": {"type": "none"},
                         "messages": [{"role": "user", "content": "no tools now"}]},
    "assistant_prefill": {**M, "messages": [{"role": "user", "content": "Count:"},
                                            {"role": "assistant", "content": "1, 2,"}]},
    "thinking_disabled_and_effort": {**M, "thinking": {"type": "disabled"}, "output_config": {"effort": "high"},
                                     "messages": [{"role": "user", "content": "quick"}]},
    "redacted_and_empty_blocks": {**M, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
                                          {"type": "text", "text": "a"}]},
        {"role": "user", "content": [{"type": "text", "text": ""}]},
        {"role": "user", "content": "z"}]},
    "assistant_tool_result": {**M, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x",
                                           "content": [{"type": "text", "text": "r"}]}]},
        {"role": "user", "content": "z"}]},
}

RESPONSES: dict[str, dict[str, Any]] = {
    "instructions_items_tools": {
        "instructions": "You are a weather assistant. Réponds brièvement 🙂", "tools": RESPONSES_TOOLS,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Wetter in Köln und 東京?"},
                                         {"type": "input_text", "text": "Kurz bitte."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "two calls"}],
             "content": [{"type": "reasoning_text", "text": "Two cities: two calls."}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
             "arguments": "{\"city\": \"Köln\"}", "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\":\"東京\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 °C, cloudy"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "22 °C"}, {"type": "input_text", "text": "clear"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Köln 18 °C, 東京 22 °C.", "annotations": []}]},
            {"role": "user", "content": "Any rain? ☔"},
        ]},
    "string_input": {"input": "hi"},
    "instructions_only": {"instructions": "Be terse.", "input": "hi"},
    "developer_and_system_items": {"instructions": "Sys.", "input": [
        {"role": "developer", "content": "Dev note."}, {"role": "system", "content": "Item system."},
        {"role": "user", "content": "u"}]},
    "assistant_string_then_user": {"input": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                                             {"role": "user", "content": "v"}]},
    "continue_incomplete_message": {"input": [
        {"role": "user", "content": "Count:"},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "1, 2,"}]}]},
    "custom_and_namespace_calls": {"tools": RESPONSES_TOOLS, "input": [
        {"role": "user", "content": "patch and read"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "--- a\n+++ b ü"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "applied"},
        {"type": "function_call", "call_id": "c2", "namespace": "fs", "name": "read", "arguments": "{}"}]},
    "reasoning_effort": {"reasoning": {"effort": "low"}, "input": "think"},
    "tool_without_parameters": {"tools": [{"type": "function", "name": "ping"}], "input": "x"},
    "empty_instructions": {"instructions": "", "input": "x"},
}

# Accepted by vLLM (some), but kvgate routes them approximately: why, per case.
UNRENDERABLE: dict[str, tuple[str, dict[str, Any]]] = {
    "messages_image": ("messages", {**M, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}]}),
    "messages_tool_use_without_id": ("messages", {**M, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "name": "t", "input": {}}]}]}),  # id from the clock
    "responses_previous_response_id": ("responses", {"previous_response_id": "resp_1", "input": "x"}),
    "responses_truncation_auto": ("responses", {"truncation": "auto", "input": "x"}),  # the replica's length
    "responses_encrypted_reasoning": ("responses", {"input": [
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], "encrypted_content": "abc"}]}),
    "responses_item_reference": ("responses", {"input": [{"type": "item_reference", "id": "msg_1"}]}),
    "responses_image": ("responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://example.com/a.png"}]}]}),
}
