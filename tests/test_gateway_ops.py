"""Health, readiness, metrics, model discovery, and what never reaches the logs."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from tests.support.stack import MODEL, start_stack


def test_readyz_names_degraded_parts_and_models_union() -> None:
    stack = start_stack(2, per_sim={"r2": {"extra_models": ("other-model",)}},
                        pool={"health_interval_s": 0.1, "eject_consecutive_failures": 1})
    try:
        ready = httpx.get(stack.url + "/readyz", timeout=5)
        assert ready.status_code == 200 and ready.json()["degraded"] == []
        models = httpx.get(stack.url + "/v1/models", timeout=5).json()["data"]
        assert sorted(m["id"] for m in models) == sorted([MODEL, "other-model"])
        assert httpx.get(stack.url + "/healthz", timeout=5).status_code == 200
        stack.faults("r2", unhealthy=True)  # only r2 serves other-model
        assert stack.wait_for(lambda: httpx.get(stack.url + "/readyz", timeout=5).status_code == 503)
        body = httpx.get(stack.url + "/readyz", timeout=5).json()
        assert any("other-model" in d for d in body["degraded"]) and any("r2" in d for d in body["degraded"])
        assert [m["id"] for m in httpx.get(stack.url + "/v1/models", timeout=5).json()["data"]] == [MODEL]
        r = httpx.post(stack.base_url + "/chat/completions", timeout=5,
                       json={"model": "other-model", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
    finally:
        stack.close()


def test_metrics_exposes_requests_tokens_and_replicas() -> None:
    stack = start_stack(1)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
        for _ in range(2):
            list(client.chat.completions.create(model=MODEL, stream=True, max_tokens=3,
                                                messages=[{"role": "user", "content": "count " * 40}]))
        text = httpx.get(stack.url + "/metrics", timeout=5).text
        assert 'kvgate_requests_total{endpoint="chat",replica="r1",status="200",tenant="default"} 2.0' in text
        assert 'kvgate_tokens_total{kind="completion",replica="r1",tenant="default"} 6.0' in text
        assert 'kvgate_tokens_total{kind="cached"' in text  # the repeat hit the replica's prefix cache
        assert 'kvgate_replica_up{replica="r1"} 1.0' in text
        assert "kvgate_time_to_first_token_seconds_bucket" in text
    finally:
        stack.close()


def test_no_key_and_no_prompt_text_in_logs(caplog: pytest.LogCaptureFixture) -> None:
    stack = start_stack(1, tenants=[{"name": "acme", "api_keys": ["sk-secret-key-123"]}])
    secret_prompt = "my-private-prompt-text-42"
    try:
        with caplog.at_level(logging.DEBUG):
            client = openai.OpenAI(base_url=stack.base_url, api_key="sk-secret-key-123", max_retries=0)
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": secret_prompt}])
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=stack.base_url, api_key="sk-wrong-key-456", max_retries=0) \
                    .chat.completions.create(model=MODEL, messages=[{"role": "user", "content": secret_prompt}])
            httpx.post(stack.base_url + "/chat/completions?api_key=sk-secret-key-123", json={}, timeout=5)
        # Our side only: the test's own HTTP client logs the URL it was told to call.
        ours = [r for r in caplog.records if r.name.startswith(("kvgate", "uvicorn", "gateway", "routing"))]
        logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in ours)
        assert any(getattr(r, "request_id", None) for r in caplog.records), "the access log ran"
        for needle in ("sk-secret-key-123", "sk-wrong-key-456", secret_prompt):
            assert needle not in logged
    finally:
        stack.close()


def test_a_span_per_request_with_usage_and_no_secrets() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    stack = start_stack(1, span_exporter=exporter, tenants=[{"name": "acme", "api_keys": ["sk-span-secret"]}])
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="sk-span-secret", max_retries=0)
        list(client.chat.completions.create(model=MODEL, stream=True, max_tokens=4,
                                            messages=[{"role": "user", "content": "span-private-text"}]))
        assert stack.wait_for(lambda: len(exporter.get_finished_spans()) == 1)
        span = exporter.get_finished_spans()[0]
        attrs = dict(span.attributes or {})
        assert attrs["kvgate.tenant"] == "acme" and attrs["kvgate.replica"] == "r1"
        assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.usage.output_tokens"] == 4
        assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["kvgate.ttft_ms"] > 0
        assert attrs["http.response.status_code"] == 200
        flat = repr(attrs) + span.name
        assert "sk-span-secret" not in flat and "span-private-text" not in flat
    finally:
        stack.close()
