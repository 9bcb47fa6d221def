"""The composed policy: evaluate (pure) and the engine the proxy calls."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import SecretStr

from policies.settings import TenantSettings
from policies.decision import PREFIX_WARNING_HEADER, evaluate
from policies.engine import PolicyEngine
from policies.errors import ApiKeyInQuery, InvalidApiKey, MissingApiKey
from policies.hygiene_state import HygieneTracker
from policies.ratelimit import RateLimiter
from policies.salt import cache_salt
from policies.tenants import Tenant, TenantRegistry, tenant_from_settings

SECRET = "decision-secret"


def tenant(**kw: Any) -> Tenant:
    return tenant_from_settings(TenantSettings(name=kw.pop("name", "acme"), **kw), SECRET)


def chat(system: str = "You are helpful.", **extra: Any) -> dict[str, Any]:
    return {"model": "llama", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": "hi"}], **extra}


TOOLS = [{"type": "function", "function": {"name": "b", "parameters": {"y": 1, "x": 2}}},
         {"type": "function", "function": {"name": "a", "parameters": {}}}]


def test_a_model_outside_the_allow_list_is_refused_like_an_unknown_model() -> None:
    body = chat(model="mistral")
    d = evaluate(tenant(models=["llama"]), body)
    assert not d.allowed and d.rejection is not None
    assert (d.rejection.status, d.rejection.code, d.rejection.param) == (404, "model_not_found", "model")
    assert d.rejection.body()["error"]["code"] == "model_not_found"
    assert d.body is body


def test_salt_is_set_and_client_fields_stripped_without_touching_the_input() -> None:
    body = chat(cache_salt="stolen", api_base="http://evil", priority=-10)
    before = copy.deepcopy(body)
    d = evaluate(tenant(), body)
    assert d.allowed and body == before
    assert d.body["cache_salt"] == cache_salt("acme", SECRET)
    assert "api_base" not in d.body and "priority" not in d.body
    assert d.stripped_fields == ("api_base", "cache_salt", "priority")


def test_tenants_in_one_namespace_share_a_salt() -> None:
    a = evaluate(tenant(name="a", namespace="team"), chat()).body["cache_salt"]
    b = evaluate(tenant(name="b", namespace="team"), chat()).body["cache_salt"]
    c = evaluate(tenant(name="c"), chat()).body["cache_salt"]
    assert a == b != c


def test_salt_only_where_vllm_takes_one() -> None:
    assert "cache_salt" in evaluate(tenant(), {"model": "llama", "prompt": "x"}, endpoint="completions").body
    emb = evaluate(tenant(), {"model": "llama", "input": "x", "cache_salt": "c"}, endpoint="embeddings").body
    assert "cache_salt" not in emb


def test_tools_are_normalised_only_for_tenants_who_opted_in() -> None:
    plain = evaluate(tenant(), chat(tools=TOOLS)).body["tools"]
    assert plain == TOOLS and list(plain[0]["function"]["parameters"]) == ["y", "x"]
    keys = evaluate(tenant(normalize_tools=True), chat(tools=TOOLS)).body["tools"]
    assert [t["function"]["name"] for t in keys] == ["b", "a"]
    assert list(keys[0]["function"]["parameters"]) == ["x", "y"]
    both = evaluate(tenant(normalize_tools=True, sort_tools=True), chat(tools=TOOLS)).body["tools"]
    assert [t["function"]["name"] for t in both] == ["a", "b"]


def test_prefix_warning_header() -> None:
    volatile = "Now: 2025-03-03T10:22:01Z. Conversation 550e8400-e29b-41d4-a716-446655440000."
    d = evaluate(tenant(), chat(volatile))
    assert dict(d.response_headers)[PREFIX_WARNING_HEADER] == "timestamp,uuid"
    assert evaluate(tenant(), chat()).response_headers == ()
    quiet = evaluate(tenant(prompt_hygiene=False), chat("Now: 2025-03-03T10:22:01Z"))
    assert quiet.response_headers == () and quiet.warnings == ()


# -- the engine ------------------------------------------------------------------------
def engine(**kw: Any) -> PolicyEngine:
    acme = TenantSettings(name="acme", api_keys=[SecretStr("sk-acme-0001")], requests_per_minute=2,
                          models=["llama"])
    reg = TenantRegistry([acme], SECRET)
    return PolicyEngine(reg, tracker=HygieneTracker(), **kw)


def test_authenticate_reads_headers_and_refuses_keys_in_the_url() -> None:
    e = engine()
    assert e.authenticate({"authorization": "Bearer sk-acme-0001"}, b"").name == "acme"
    assert e.authenticate([("x-other", "1"), ("api-key", "sk-acme-0001")]).name == "acme"
    with pytest.raises(MissingApiKey):
        e.authenticate({}, b"")
    with pytest.raises(InvalidApiKey):
        e.authenticate({"authorization": "Basic abc"}, b"")
    with pytest.raises(ApiKeyInQuery) as err:
        e.authenticate({"authorization": "Bearer sk-acme-0001"}, b"api_key=sk-acme-0001")
    assert err.value.status == 401 and "sk-acme-0001" not in err.value.message


@pytest.mark.anyio
async def test_admit_applies_policy_then_rate_limits() -> None:
    e = engine()
    t = e.authenticate({"authorization": "Bearer sk-acme-0001"})
    refused_model = await e.admit(t, "chat", chat(model="other"))
    assert refused_model.rejection is not None and refused_model.rejection.status == 404
    first = await e.admit(t, "chat", chat())
    assert first.allowed and ("x-ratelimit-remaining-requests", "1") in first.response_headers
    await e.admit(t, "chat", chat())
    limited = await e.admit(t, "chat", chat())
    assert limited.rejection is not None
    assert (limited.rejection.status, limited.rejection.code) == (429, "rate_limit_exceeded")
    assert limited.rejection.retry_after_s is not None and limited.rejection.retry_after_s >= 1
    assert ("x-ratelimit-remaining-requests", "0") in limited.rejection.headers
    assert json.dumps(limited.rejection.body())


@pytest.mark.anyio
async def test_admit_reports_cross_request_tool_nondeterminism() -> None:
    reg = TenantRegistry([], SECRET)
    e = PolicyEngine(reg, RateLimiter(None), HygieneTracker())
    t = e.authenticate({})
    assert (await e.admit(t, "chat", chat(tools=TOOLS))).response_headers == ()
    swapped = [TOOLS[1], TOOLS[0]]
    second = await e.admit(t, "chat", chat(tools=swapped))
    assert dict(second.response_headers)[PREFIX_WARNING_HEADER] == "tool_order"
    report = e.tracker.report().to_dict() if e.tracker else {}
    assert report["tenants"]["default"]["kinds"]["tool_order"]["count"] == 1


@pytest.mark.anyio
async def test_record_usage_and_readiness() -> None:
    e = engine()
    t = e.authenticate({"x-api-key": "sk-acme-0001"})
    await e.record_usage(t, 100)  # no token limit: nothing to do, never raises
    assert e.readiness() == {"tenants": "ok", "rate_limits": "ok"}
