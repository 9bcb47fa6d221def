"""``/v1/audio/transcriptions`` and ``/v1/audio/translations``: a deterministic transcript of the file's bytes.

The transcript is words picked by CRC32 of successive slices of the audio, about
two words per second of audio (WAV duration from its header; anything else is
taken as 16 kHz 16-bit mono): the same file always gives the same text, a
different file another. Shapes follow vLLM's ``TranscriptionResponse``,
``TranscriptionResponseVerbose``, ``TranslationResponse`` and, with ``stream``,
``transcription.chunk`` / ``translation.chunk`` SSE events ending in ``[DONE]``.
The words are decoded by the replica's engine (one token each, after a prefill
of ``audio_tokens``), so audio requests load the replica, take the timing
model's time, abort on a client disconnect and obey the per-token faults.
Like vLLM, only ``json``, ``text`` (answered as JSON) and ``verbose_json``
formats are served.
"""

from __future__ import annotations

import io
import math
import struct
import time
import uuid
import wave
import zlib
from dataclasses import dataclass
from typing import Any, Literal

from vllm_sim.wire import ApiError, sse

__all__ = ["AudioRequest", "StreamFormat", "Task", "audio_response", "audio_tokens", "duration_s", "synthetic_wav",
           "transcript"]

Task = Literal["transcribe", "translate"]
_WORDS = ("the", "sound", "of", "rain", "on", "a", "quiet", "street", "and", "distant", "voices",
          "speaking", "about", "trains", "morning", "light", "river", "city", "market", "song")
_WORDS_PER_SECOND = 2
_MAX_WORDS = 256
_FORMATS = ("json", "text", "verbose_json")
_AUDIO_TOKENS_PER_SECOND = 50
_AUDIO_TOKENS_MAX = 1500


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


def synthetic_wav(seconds: float, rate: int = 16000) -> bytes:
    """A mono 16-bit WAV of ``seconds`` (a sawtooth), for tests and benchmarks to upload."""
    frames = int(rate * seconds)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(struct.pack(f"<{frames}h", *((i * 37) % 3000 for i in range(frames))))
    return out.getvalue()


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


def audio_tokens(audio: bytes) -> list[int]:
    """The prompt the engine prefills: an encoder's 50 positions per second of audio, up to one
    30-second window (Whisper's 1500), as ids derived from the bytes (the same file, the same ids)."""
    n = max(1, min(_AUDIO_TOKENS_MAX, math.ceil(duration_s(audio) * _AUDIO_TOKENS_PER_SECOND)))
    step = max(1, len(audio) // n)
    return [zlib.crc32(audio[i * step : (i + 1) * step], 7) for i in range(n)]


class StreamFormat:
    """The SSE events of one streamed transcription or translation (vLLM dumps them with
    ``exclude_unset``: no ``usage`` key on content chunks, ``finish_reason`` on the last only)."""

    def __init__(self, req: AudioRequest) -> None:
        self.req = req
        self.kind = "transcription.chunk" if req.task == "transcribe" else "translation.chunk"
        self.rid = ("trsc-" if req.task == "transcribe" else "trsl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def word(self, words: list[str], i: int) -> bytes:
        choice: dict[str, Any] = {"delta": {"content": words[i] if i == 0 else " " + words[i]}}
        if i == len(words) - 1:
            choice.update(finish_reason="stop", stop_reason=None)
        return sse({"id": self.rid, "object": self.kind, "created": self.created, "model": self.req.model,
                    "choices": [choice]})

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return sse({"id": self.rid, "object": self.kind, "created": self.created, "model": self.req.model,
                    "choices": [], "usage": usage})
