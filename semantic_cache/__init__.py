"""kvgate's semantic cache: answer repeated questions in milliseconds, never wrongly.

Two tiers behind one facade (``SemanticCache``):

* exact: a hash of the whole request, no embedding;
* semantic: the final user message's embedding, searched only among entries
  of the same partition (namespace + model + everything else in the request),
  then re-checked by a rule-based verifier before anything is served.

Constraints this package keeps: ``cache_request`` and ``replay`` are pure;
lookups and stores never raise (a fault is a miss); entries are written only
from complete, successful answers; a hung or dead Redis costs at most one
socket timeout before a circuit breaker takes it out of the request path.
"""

from .cache import SemanticCache
from .embedder import Embedder, EmbedderError, HashEmbedder, LocalEmbedder, RemoteEmbedder
from .keys import cache_request
from .models import CachedAnswer, CacheRequest, Lookup
from .replay import completion_body, sse_events
from .settings import SemanticCacheSettings
from .store import StoreUnavailable

__all__ = [
    "CacheRequest", "CachedAnswer", "Embedder", "EmbedderError", "HashEmbedder", "LocalEmbedder", "Lookup",
    "RemoteEmbedder", "SemanticCache", "SemanticCacheSettings", "StoreUnavailable", "cache_request",
    "completion_body", "sse_events",
]
