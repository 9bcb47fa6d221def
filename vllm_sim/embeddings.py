"""``/v1/embeddings``: deterministic unit vectors, as a pure function of the request body.

Vectors are a signed hashed bag of tokens (the "hashing trick"), not random
per text: texts sharing most tokens get a high cosine, unrelated texts a low
one, so a semantic cache tested against the simulator has real neighbours to
find and real near-misses to reject. The same text always gives the same vector.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from typing import Any, Sequence

from vllm_sim.config import SimConfig
from vllm_sim.protocol import resolve_model
from vllm_sim.tokenizer import tokenize
from vllm_sim.wire import ApiError

__all__ = ["embed", "embeddings_response", "input_token_ids"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_FEATURES_PER_TOKEN = 3


def embed(token_ids: Sequence[int], dim: int) -> list[float]:
    """A unit vector of ``dim`` floats for ``token_ids``; an empty input gets the first basis vector."""
    vec = [0.0] * dim
    for token in token_ids:
        h = ((token + 1) * _GOLDEN) & _MASK
        for k in range(_FEATURES_PER_TOKEN):
            vec[(h >> (k * 16)) % dim] += 1.0 if (h >> (61 + k)) & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vec))
    if norm == 0.0:
        vec[0] = 1.0
        return vec
    return [v / norm for v in vec]


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vec
    packed = array("f", vec)
    if sys.byteorder == "big":
        packed.byteswap()  # the wire format is little-endian float32, as OpenAI's SDK decodes it
    return base64.b64encode(packed.tobytes()).decode()


def input_token_ids(value: Any) -> list[list[int]]:
    """Token ids per input: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return [tokenize(value)]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [tokenize(v) for v in value]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [list(value)]
        if all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value):
            return [list(v) for v in value]
    raise ApiError(400, "input must be a string, a list of strings or token ids.", param="input")


def embeddings_response(body: dict[str, Any], config: SimConfig, rid: str, created: int) -> dict[str, Any]:
    """The full response body for an embeddings request; raises ``ApiError`` on a bad request."""
    model = resolve_model(body, config)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be 'float' or 'base64'.", param="encoding_format")
    dim = body.get("dimensions") or config.embedding_dim
    if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= config.embedding_dim:
        message = f"dimensions must be an integer in [1, {config.embedding_dim}]."
        raise ApiError(400, message, param="dimensions")
    inputs = input_token_ids(body.get("input"))
    data = []
    limit = config.max_model_len
    for i, ids in enumerate(inputs):
        if len(ids) > limit:
            message = f"input {i} has {len(ids)} tokens, above max_model_len {limit}."
            raise ApiError(400, message, param="input")
        data.append({"index": i, "object": "embedding", "embedding": _encode(embed(ids, dim), fmt)})
    tokens = sum(len(ids) for ids in inputs)
    return {
        "id": rid,
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    }
