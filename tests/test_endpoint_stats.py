"""The status page's per-endpoint rows count what the proxy saw, split by who failed."""

from __future__ import annotations

from gateway.observe.endpoint_stats import EndpointStats


def test_rows_count_errors_by_cause_and_average_only_what_was_measured() -> None:
    stats = EndpointStats()
    stats.record("chat", 200, 0.2, 0.05)
    stats.record("chat", 200, 0.4, None)  # a unary answer: no time to first token
    stats.record("chat", 499, 0.1, None)
    stats.record("messages", 502, 0.3, None)
    stats.record("messages", 400, 0.001, None)
    stats.record("chat", 400, 0.3, None)
    chat, messages = stats.rows()
    assert chat["endpoint"] == "chat" and chat["requests"] == 4
    assert chat["client_errors"] == 2 and chat["server_errors"] == 0
    assert abs(chat["mean_latency_s"] - 0.25) < 1e-9 and abs(chat["mean_ttft_s"] - 0.05) < 1e-9
    assert messages["client_errors"] == 1 and messages["server_errors"] == 1 and messages["mean_ttft_s"] is None
