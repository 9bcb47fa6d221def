"""API keys: generation, hashing, and finding them in a request. Pure.

Keys are never kept in plaintext: the registry keeps only
``HMAC-SHA256(derive_hash_key(server_secret), key)``. The HMAC (rather than a
bare SHA-256) means a copy of the store without the server secret cannot even
test guesses against weak operator-chosen keys. Generated keys carry 256 bits
of randomness, so they are not guessable either way.

Where a client may put its key (``extract_api_key``):
  * ``Authorization: Bearer <key>`` (OpenAI SDKs),
  * ``api-key: <key>`` (the Azure OpenAI SDK's header),
  * ``x-api-key: <key>`` (common in other SDKs and curl scripts).
Accepting the two extra headers costs nothing, because the gateway must strip
every client credential header before forwarding anyway (``CLIENT_AUTH_HEADERS``).
If two of them carry *different* keys, the request is ambiguous (often a proxy
in front added one) and is treated as malformed rather than guessing.

Keys in the query string are refused, not used: URLs land in access logs,
browser history and referrers (``query_has_api_key``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from urllib.parse import parse_qsl, unquote_plus

KEY_PREFIX = "sk-kvg-"
MAX_KEY_CHARS = 256
KEY_ID_HEX = 12  # 48 bits: a display/revocation handle, collision-checked on issue

# Every header that may carry a client credential; strip all of them upstream.
CLIENT_AUTH_HEADERS = ("authorization", "api-key", "x-api-key")
QUERY_KEY_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "access_token", "token", "x-api-key"})

# Printable ASCII without spaces; anything else cannot be a key we issued or accepted.
_WELL_FORMED = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr][ \t]+(\S+)[ \t]*")
_HASH_LABEL = b"kvgate/api-key/v1"


def generate_key() -> str:
    """A new key: ``sk-kvg-`` + 32 random bytes, urlsafe base64 (43 characters)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def derive_hash_key(server_secret: str | bytes) -> bytes:
    """The key-hashing HMAC key, domain-separated from other uses of the server secret."""
    secret = server_secret.encode() if isinstance(server_secret, str) else server_secret
    return hmac.new(secret, _HASH_LABEL, hashlib.sha256).digest()


def hash_key(hash_secret: bytes, key: str) -> bytes:
    """HMAC-SHA256 of a key (32 bytes). Callers compare digests with ``hmac.compare_digest``."""
    return hmac.new(hash_secret, key.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()


def key_id(digest: bytes | str) -> str:
    """A short public handle for a key: the first hex characters of its hash."""
    hexed = digest.hex() if isinstance(digest, bytes) else digest
    return hexed[:KEY_ID_HEX]


def is_well_formed(key: str) -> bool:
    return _WELL_FORMED.fullmatch(key) is not None


def _credentials(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> list[str]:
    items = headers.items() if isinstance(headers, Mapping) else headers
    found: list[str] = []
    for name, value in items:
        lname = name.lower()
        if lname == "authorization":
            m = _BEARER.fullmatch(value.strip())
            # A non-Bearer scheme is still a credential the client meant to send: "" = malformed.
            found.append(m.group(1) if m else "")
        elif lname in ("api-key", "x-api-key") and value.strip():
            found.append(value.strip())  # an empty one is ignored: some clients always send it
    return found


def extract_api_key(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> str | None:
    """The client's key from its headers.

    Returns None when no credential header is present, and "" when one is
    present but unusable (wrong scheme, empty, or conflicting keys), so that
    ``TenantRegistry.authenticate`` can tell missing from malformed while both
    still take the same hashing path. Accepts a mapping (names in any case) or
    ASGI-style ``(name, value)`` pairs, where repeated headers are all seen.
    """
    found = _credentials(headers)
    if not found:
        return None
    distinct = set(found)
    return distinct.pop() if len(distinct) == 1 else ""


def query_has_api_key(query: str | bytes | None) -> bool:
    """True when the query string carries a parameter that looks like a credential.

    The caller answers 401 and must not log the query string of such a request.
    """
    if not query:
        return False
    text = query.decode("latin-1") if isinstance(query, bytes) else query
    try:
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=1000)
    except ValueError:
        # More than 1000 fields: not a legitimate OpenAI call; treat as suspicious.
        return True
    return any(name.strip().lower() in QUERY_KEY_PARAMS for name, _ in pairs)


def redact_query(query: str | bytes | None) -> str:
    """The query string with every credential-like value replaced, for logs."""
    if not query:
        return ""
    text = query.decode("latin-1") if isinstance(query, bytes) else query
    parts = []
    for part in text.split("&"):
        name = part.split("=", 1)[0]
        sensitive = unquote_plus(name).strip().lower() in QUERY_KEY_PARAMS
        parts.append(f"{name}=REDACTED" if sensitive else part)
    return "&".join(parts)
