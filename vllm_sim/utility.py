"""vLLM's tokenizer and pooling routes, as pure functions from a request body to vLLM's response body.

``/tokenize``, ``/detokenize``, ``/rerank`` (also ``/v1/rerank``, ``/v2/rerank``),
``/score`` (also ``/v1/score``), ``/pooling``, ``/classify``. Shapes follow vLLM's
protocol models (``TokenizeResponse``, ``DetokenizeResponse``, ``RerankResponse``,
``ScoreResponse``, ``PoolingResponse``, ``ClassificationResponse``); the test
suite checks them against those models when vLLM is installed.

Scores are deterministic and mean something: a pair's relevance is the cosine
of the simulator's hashed bag-of-tokens vectors (``embeddings.embed``) mapped
to [0, 1], so a document sharing words with the query ranks above one that
shares none. Classification probabilities come from the same vector.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from vllm_sim.config import SimConfig
from vllm_sim.embeddings import embed, input_token_ids
from vllm_sim.protocol import resolve_model
from vllm_sim.template import content_text, render_chat
from vllm_sim.tokenizer import token_strs, tokenize
from vllm_sim.wire import ApiError

__all__ = ["CLASS_LABELS", "Vocabulary", "classify", "detokenize", "pooling", "rerank", "score", "tokenize_body"]

CLASS_LABELS = ("negative", "positive")
_SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class Vocabulary:
    """Token id -> text for the ids this replica's /tokenize handed out, bounded (LRU).

    The simulator's ids are CRC32s of text pieces, so they cannot be inverted; an id
    never seen detokenizes to ``<|id|>``."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._texts: OrderedDict[int, str] = OrderedDict()
        self._capacity = capacity

    def learn(self, ids: list[int], texts: list[str]) -> None:
        for token, text in zip(ids, texts):
            self._texts[token] = text
            self._texts.move_to_end(token)
        while len(self._texts) > self._capacity:
            self._texts.popitem(last=False)

    def text(self, token: int) -> str:
        return self._texts.get(token, f"<|{token}|>")


def _usage(tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


def _checked(ids: list[int], config: SimConfig, param: str) -> list[int]:
    if len(ids) > config.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {config.max_model_len} tokens. "
                            f"However, you requested {len(ids)} tokens in the input.", param=param)
    return ids


def _text_of(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "content" in value:
        return content_text(value["content"])
    raise ApiError(400, f"{param} must be a string or a content object.", param=param)


def _prompt_text(body: dict[str, Any], add_generation_prompt: bool) -> str:
    if body.get("messages") is not None:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a list of objects.", param="messages")
        return render_chat(messages, body.get("tools"), add_generation_prompt)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "Either prompt or messages must be given.", param="prompt")
    return prompt


def tokenize_body(body: dict[str, Any], config: SimConfig, vocab: Vocabulary) -> dict[str, Any]:
    resolve_model(body, config)
    text = _prompt_text(body, add_generation_prompt=bool(body.get("add_generation_prompt", True)))
    ids, strs = tokenize(text), token_strs(text)
    vocab.learn(ids, strs)
    return {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids,
            "token_strs": strs if body.get("return_token_strs") else None}


def detokenize(body: dict[str, Any], config: SimConfig, vocab: Vocabulary) -> dict[str, Any]:
    resolve_model(body, config)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in tokens):
        raise ApiError(400, "tokens must be a list of non-negative integers.", param="tokens")
    return {"prompt": "".join(vocab.text(t) for t in tokens)}


def _relevance(a: list[int], b: list[int], dim: int) -> float:
    cos = sum(x * y for x, y in zip(embed(a, dim), embed(b, dim)))
    return round(min(1.0, max(0.0, (1.0 + cos) / 2.0)), 6)


def _many(value: Any, param: str) -> list[str]:
    if isinstance(value, list):
        if not value:
            raise ApiError(400, f"{param} must not be empty.", param=param)
        return [_text_of(v, param) for v in value]
    return [_text_of(value, param)]


def rerank(body: dict[str, Any], config: SimConfig, rid: str) -> dict[str, Any]:
    model = resolve_model(body, config)
    query = tokenize(_text_of(body.get("query"), "query"))
    docs = _many(body.get("documents"), "documents")
    top_n = body.get("top_n") or 0
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise ApiError(400, "top_n must be a non-negative integer.", param="top_n")
    results, tokens = [], 0
    for i, doc in enumerate(docs):
        ids = _checked(query + tokenize(doc), config, "documents")
        tokens += len(ids)
        results.append({"index": i, "document": {"text": doc, "multi_modal": None},
                        "relevance_score": _relevance(query, tokenize(doc), config.embedding_dim)})
    results.sort(key=lambda r: (-r["relevance_score"], r["index"]))  # type: ignore[operator]
    return {"id": rid, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results[:top_n] if top_n else results}


def score(body: dict[str, Any], config: SimConfig, rid: str, created: int) -> dict[str, Any]:
    model = resolve_model(body, config)
    pair = next(((a, b) for a, b in _SCORE_PAIRS if a in body and b in body), None)
    if pair is None:
        raise ApiError(400, "Score needs queries and documents (or items, data_1/data_2, text_1/text_2).")
    left, right = _many(body[pair[0]], pair[0]), _many(body[pair[1]], pair[1])
    if len(left) == 1:
        left = left * len(right)  # one query against every document, as vLLM pairs them
    if len(left) != len(right):
        raise ApiError(400, f"{pair[0]} and {pair[1]} must have the same length, or {pair[0]} a single one.",
                       param=pair[1])
    data, tokens = [], 0
    for i, (a, b) in enumerate(zip(left, right)):
        ia, ib = tokenize(a), tokenize(b)
        tokens += len(_checked(ia + ib, config, pair[1]))
        data.append({"index": i, "object": "score", "score": _relevance(ia, ib, config.embedding_dim)})
    return {"id": rid, "object": "list", "created": created, "model": model, "data": data, "usage": _usage(tokens)}


def _inputs(body: dict[str, Any]) -> list[list[int]]:
    if body.get("messages") is not None:
        return [tokenize(_prompt_text(body, add_generation_prompt=bool(body.get("add_generation_prompt"))))]
    return input_token_ids(body.get("input"))  # the same input forms as /v1/embeddings


def pooling(body: dict[str, Any], config: SimConfig, rid: str, created: int) -> dict[str, Any]:
    model = resolve_model(body, config)
    inputs = [_checked(ids, config, "input") for ids in _inputs(body)]
    data = [{"index": i, "object": "pooling", "data": embed(ids, config.embedding_dim)}
            for i, ids in enumerate(inputs)]
    return {"id": rid, "object": "list", "created": created, "model": model, "data": data,
            "usage": _usage(sum(len(ids) for ids in inputs))}


def classify(body: dict[str, Any], config: SimConfig, rid: str, created: int) -> dict[str, Any]:
    model = resolve_model(body, config)
    inputs = [_checked(ids, config, "input") for ids in _inputs(body)]
    data = []
    for i, ids in enumerate(inputs):
        # A logistic of the input vector's coordinate sum (its projection on the all-ones
        # direction): deterministic, and different texts land all over (0, 1).
        positive = round(1.0 / (1.0 + math.exp(-2.0 * sum(embed(ids, config.embedding_dim)))), 6)
        probs = [round(1.0 - positive, 6), positive]
        data.append({"index": i, "label": CLASS_LABELS[probs.index(max(probs))], "probs": probs,
                     "num_classes": len(CLASS_LABELS)})
    return {"id": rid, "object": "list", "created": created, "model": model, "data": data,
            "usage": _usage(sum(len(ids) for ids in inputs))}
