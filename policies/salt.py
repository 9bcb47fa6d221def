"""KV-cache isolation between tenants, and the body fields a client may not set. Pure.

vLLM mixes ``cache_salt`` into the hash of a prompt's first block, so two
requests share KV blocks only when their salts are equal. Without it, tenant B
can time its own requests to learn whether tenant A recently sent a prompt
(Gu et al., ICML 2025). Each cache namespace therefore gets its own salt,
derived from the server secret so it is stable across restarts and instances
but unguessable by clients; tenants configured into one namespace share a salt
(and so share KV blocks) on purpose.

The salt must come from us, never from the client: a client that could choose
its salt could choose another tenant's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

_SALT_LABEL = b"kvgate/cache-salt/v1\x00"

# Fields a client must never control. A denylist, not an allowlist, on purpose:
# vLLM accepts dozens of legitimate extensions to the OpenAI schema (top_k,
# min_p, guided_json, chat_template_kwargs, ...) and OpenAI keeps adding
# parameters, so an allowlist would break clients with every release of either.
# What is listed here does harm when a client sets it:
STRIPPED_FIELDS: Mapping[str, str] = {
    # isolation: only the gateway chooses the salt / KV transfer source
    "cache_salt": "KV isolation is set by the gateway",
    "kv_transfer_params": "could pull KV blocks computed for another tenant (disaggregated prefill)",
    # routing and credentials: upstream hosts come only from configuration
    "api_base": "upstream hosts come only from configuration",
    "base_url": "upstream hosts come only from configuration",
    "api_key": "credentials never travel in the body",
    "api_version": "SDK transport setting, meaningless upstream",
    "azure_endpoint": "upstream hosts come only from configuration",
    "organization": "SDK transport setting, meaningless upstream",
    "custom_llm_provider": "proxy routing hint (litellm); upstream comes from configuration",
    "extra_headers": "SDK transport setting; never forwarded as data",
    "extra_query": "SDK transport setting; never forwarded as data",
    "extra_body": "SDK transport setting; never forwarded as data",
    # scheduling and server-side code: the gateway owns these
    "priority": "would let a client jump vLLM's queue ahead of other tenants",
    "request_id": "the gateway's request id names the upstream request; client ids could collide",
    "chat_template": "a client-supplied Jinja template runs server-side and changes the prompt layout",
    "logits_processors": "names server-side code to load",
    "vllm_xargs": "arbitrary arguments to server-side extensions",
}


def cache_salt(namespace: str, secret: str | bytes) -> str:
    """The salt for a namespace: HMAC-SHA256(secret, label + namespace), 128 bits, urlsafe.

    22 characters; the same namespace and secret always give the same salt.
    Changing the server secret changes every salt (every prefix cache goes cold once).
    """
    key = secret.encode() if isinstance(secret, str) else secret
    mac = hmac.new(key, _SALT_LABEL + namespace.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac[:16]).rstrip(b"=").decode("ascii")


def apply_salt(body: Mapping[str, Any], salt: str) -> dict[str, Any]:
    """A shallow copy of ``body`` with ``cache_salt`` set to ``salt``; the input is not modified.

    Any client-supplied value is overwritten. Only the endpoints whose vLLM request
    model has a ``cache_salt`` field take one (``decision._SALTED``); not tokenize or audio.
    """
    out = dict(body)
    out["cache_salt"] = salt
    return out


def strip_client_fields(body: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A shallow copy of ``body`` without ``STRIPPED_FIELDS``, and the names removed (sorted).

    The names (never the values) may go to metrics or a debug header.
    """
    removed = tuple(sorted(k for k in body if k in STRIPPED_FIELDS))
    if not removed:
        return dict(body), ()
    return {k: v for k, v in body.items() if k not in STRIPPED_FIELDS}, removed
