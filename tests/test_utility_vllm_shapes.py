"""The simulator's utility, pooling and audio answers, validated by vLLM's own pydantic protocol models.

The test bodies themselves are validated by vLLM's request models too, so what
the gateway's tests send is what a real vLLM accepts. Runs in the session's
vLLM interpreter (tests/support/vllm_env.py); skips, saying why, without vLLM.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.vllm_env import VllmWorker
from vllm_sim.audio import synthetic_wav as wav
from vllm_sim.config import SimConfig
from vllm_sim.server import build_app

MODEL = "sim-model"


# (path, request body, vLLM request model, vLLM response model); models named module:Class.
_TOK = "vllm.entrypoints.serve.tokenize.protocol"
_SCO = "vllm.entrypoints.pooling.scoring.protocol"
_POOL = "vllm.entrypoints.pooling.pooling.protocol"
_CLS = "vllm.entrypoints.pooling.classify.protocol"
_TR = "vllm.entrypoints.speech_to_text.transcription.protocol"
_TL = "vllm.entrypoints.speech_to_text.translation.protocol"
JSON_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("/tokenize", {"prompt": "Hello there", "return_token_strs": True},
     f"{_TOK}:TokenizeCompletionRequest", f"{_TOK}:TokenizeResponse"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]},
     f"{_TOK}:TokenizeChatRequest", f"{_TOK}:TokenizeResponse"),
    ("/detokenize", {"tokens": [1, 2]}, f"{_TOK}:DetokenizeRequest", f"{_TOK}:DetokenizeResponse"),
    ("/rerank", {"query": "rain", "documents": ["rain falls", "sun"], "top_n": 1},
     f"{_SCO}:RerankRequest", f"{_SCO}:RerankResponse"),
    ("/score", {"queries": "rain", "documents": ["rain falls", "sun"]},
     f"{_SCO}:ScoreQueriesDocumentsRequest", f"{_SCO}:ScoreResponse"),
    ("/score", {"text_1": "rain", "text_2": "sun"}, f"{_SCO}:ScoreTextRequest", f"{_SCO}:ScoreResponse"),
    ("/pooling", {"input": ["a b", "c"]}, f"{_POOL}:PoolingCompletionRequest", f"{_POOL}:PoolingResponse"),
    ("/classify", {"input": "fine"}, f"{_CLS}:ClassificationCompletionRequest", f"{_CLS}:ClassificationResponse"),
]
AUDIO_CASES: list[tuple[str, dict[str, str], str]] = [
    ("/v1/audio/transcriptions", {}, f"{_TR}:TranscriptionResponse"),
    ("/v1/audio/transcriptions", {"response_format": "verbose_json"}, f"{_TR}:TranscriptionResponseVerbose"),
    ("/v1/audio/translations", {}, f"{_TL}:TranslationResponse"),
]
STREAM_CASES = [("/v1/audio/transcriptions", f"{_TR}:TranscriptionStreamResponse"),
                ("/v1/audio/translations", f"{_TL}:TranslationStreamResponse")]

# Run under vLLM's python: validate each (model, object); report what fails, and any
# field the simulator sends that the model does not declare.
_CHECK = r"""
import importlib, json, sys
failures = []
for ref, obj in json.load(open(sys.argv[1])):
    module, name = ref.split(":")
    cls = getattr(importlib.import_module(module), name)
    try:
        cls.model_validate(obj)
    except Exception as exc:
        failures.append(f"{ref}: {exc}")
        continue
    extra = sorted(set(obj) - set(cls.model_fields) - {a.alias for a in cls.model_fields.values() if a.alias})
    if extra:
        failures.append(f"{ref}: fields vLLM does not send: {extra}")
print(json.dumps(failures))
"""


async def _collect() -> list[tuple[str, Any]]:
    pairs: list[tuple[str, Any]] = []
    app = build_app(SimConfig(model=MODEL))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://sim") as client:
        for path, body, request_model, response_model in JSON_CASES:
            body = {"model": MODEL, **body}
            r = await client.post(path, json=body)
            assert r.status_code == 200, r.text
            pairs += [(request_model, body), (response_model, r.json())]
        for path, fields, response_model in AUDIO_CASES:
            r = await client.post(path, data={"model": MODEL, **fields}, files={"file": ("a.wav", wav(1.0))})
            assert r.status_code == 200, r.text
            pairs.append((response_model, r.json()))
        for path, chunk_model in STREAM_CASES:
            r = await client.post(path, files={"file": ("a.wav", wav(1.0))},
                                  data={"model": MODEL, "stream": "true", "stream_include_usage": "true"})
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            pairs += [(chunk_model, orjson.loads(e)) for e in events[:-1]]
    return pairs


@pytest.mark.timeout(300)
def test_sim_utility_shapes_match_vllm_protocol_models(tmp_path: Path, vllm_worker: VllmWorker) -> None:
    pairs = asyncio.run(_collect())
    data = tmp_path / "shapes.json"
    data.write_text(json.dumps(pairs))
    out = vllm_worker.run(_CHECK, str(data), timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert failures == [], "\n".join(failures)
    assert len(pairs) > 20 and sys.executable != vllm_worker.python
