"""``/v1/audio/transcriptions`` and ``/v1/audio/translations``: a deterministic transcript of the file's bytes.

The transcript is words picked by CRC32 of successive slices of the audio, about
two words per second of audio (WAV duration from its header; anything else is
taken as 16 kHz 16-bit mono): the same file always gives the same text, a
different file another. Shapes follow vLLM's ``TranscriptionResponse``,
``TranscriptionResponseVerbose``, ``TranslationResponse`` and, with ``stream``,
``transcription.chunk`` / ``translation.chunk`` SSE events ending in ``[DONE]``.
Like vLLM, only ``json``, ``text`` (answered as JSON) and ``verbose_json``
formats are served.
"""

from __future__ import annotations

import io
import math
import time
import uuid
import wave
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Literal

from vllm_sim.tokenizer import count_tokens
from vllm_sim.wire import DONE, ApiError, sse

__all__ = ["AudioRequest", "Task", "audio_events", "audio_response", "duration_s", "transcript"]

Task = Literal["transcribe", "translate"]
_WORDS = ("the", "sound", "of", "rain", "on", "a", "quiet", "street", "and", "distant", "voices",
          "speaking", "about", "trains", "morning", "light", "river", "city", "market", "song")
_WORDS_PER_SECOND = 2
_MAX_WORDS = 256
_FORMATS = ("json", "text", "verbose_json")


@dataclass(frozen=True, slots=True)
class AudioRequest:
    task: Task
    model: str
    audio: bytes
    response_format: str = "json"
    language: str | None = None
    stream: bool = False
    include_usage: bool = False

    def check(self) -> None:
        if not self.audio:
            raise ApiError(400, "The audio file is empty.", param="file")
        if self.response_format not in _FORMATS:
            raise ApiError(400, "Currently only support response_format: `text`, `json` or `verbose_json`",
                           param="response_format")
        if self.response_format == "verbose_json" and self.stream:
            raise ApiError(400, "verbose_json format doesn't support streaming case", param="response_format")
        if self.include_usage and not self.stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                           param="stream_include_usage")


def duration_s(audio: bytes) -> float:
    try:
        with wave.open(io.BytesIO(audio)) as w:
            return w.getnframes() / float(w.getframerate() or 1)
    except (wave.Error, EOFError):
        return len(audio) / 32000.0


def transcript(audio: bytes) -> list[str]:
    """The words of ``audio``'s transcript, one string per word."""
    n = max(1, min(_MAX_WORDS, round(duration_s(audio) * _WORDS_PER_SECOND)))
    step = max(1, len(audio) // n)
    return [_WORDS[zlib.crc32(audio[i * step : (i + 1) * step], i) % len(_WORDS)] for i in range(n)]


def audio_response(req: AudioRequest) -> dict[str, Any]:
    words = transcript(req.audio)
    text = " ".join(words)
    seconds = duration_s(req.audio)
    if req.response_format == "verbose_json":
        segment = {"id": 0, "avg_logprob": -0.1, "compression_ratio": 1.0, "end": round(seconds, 3),
                   "no_speech_prob": 0.0, "seek": 0, "start": 0.0, "temperature": 0.0, "text": text,
                   "tokens": list(range(len(words)))}
        return {"duration": str(seconds), "language": req.language or "en", "text": text,
                "segments": [segment], "words": None}
    if req.task == "transcribe":
        return {"text": text, "usage": {"type": "duration", "seconds": int(math.ceil(seconds))}}
    return {"text": text}


def audio_events(req: AudioRequest) -> Iterator[bytes]:
    """The SSE events of a streamed transcription or translation, ``[DONE]`` last."""
    kind = "transcription.chunk" if req.task == "transcribe" else "translation.chunk"
    rid = ("trsc-" if req.task == "transcribe" else "trsl-") + uuid.uuid4().hex
    created = int(time.time())
    words = transcript(req.audio)
    for i, word in enumerate(words):
        choice: dict[str, Any] = {"delta": {"content": word if i == 0 else " " + word}}
        if i == len(words) - 1:
            choice.update(finish_reason="stop", stop_reason=None)
        yield sse({"id": rid, "object": kind, "created": created, "model": req.model, "choices": [choice]})
    if req.include_usage:
        prompt = count_tokens(" ".join(words))
        usage = {"prompt_tokens": prompt, "completion_tokens": len(words), "total_tokens": prompt + len(words)}
        yield sse({"id": rid, "object": kind, "created": created, "model": req.model, "choices": [],
                   "usage": usage})
    yield DONE
