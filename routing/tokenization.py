"""Which token source serves each model, and how each has fared.

Built once from ``routing.tokenizers`` and ``routing.render_url``: a model
with a tokenizer directory is tokenized in process; any other model is asked
of the render server when one is configured; the rest route approximately.
A directory that fails to load is logged and reported (its model routes
approximately) rather than stopping the gateway: routing quality degrades,
serving does not. Only requests of ``TOKEN_ENDPOINTS`` (chat, completions,
Messages, Responses) are tokenized and counted; the counts are kept per model
and per endpoint for /admin/routing.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from .render_tokens import RenderTokenSource
from .settings import RoutingSettings
from .tokens import TOKEN_ENDPOINTS, HFTokenSource, TokenSource

__all__ = ["Tokenization", "Mode"]

log = logging.getLogger("kvgate.routing")

Mode = Literal["in-process", "render", "approximate"]


class Tokenization:
    def __init__(self, settings: RoutingSettings, *, render: RenderTokenSource | None = None) -> None:
        self.settings = settings
        self.sources: dict[str, TokenSource] = {}
        self.errors: dict[str, str] = {}
        self.render = render
        if self.render is None and settings.render_url:
            self.render = RenderTokenSource(settings.render_url, timeout_s=settings.render_timeout_s)
        self.loaded = not settings.tokenizers
        self.exact: dict[str, int] = {}
        self.fallback: dict[str, int] = {}
        self.by_endpoint: dict[str, dict[str, dict[str, int]]] = {}  # model -> endpoint -> exact/fallback

    def load(self) -> "Tokenization":
        """Load the tokenizer directories (seconds: transformers imports torch); blocking, run it in a thread."""
        for model, directory in sorted(self.settings.tokenizers.items()):
            try:
                self.sources[model] = HFTokenSource(directory)
            except Exception as err:  # a bad path or files: this model routes approximately
                self.errors[model] = f"{type(err).__name__}: {err}"[:300]
                log.error("tokenizer for model %s at %s did not load (%s); routing it approximately",
                          model, directory, self.errors[model])
        self.loaded = True
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.sources) or self.render is not None

    def mode(self, model: str) -> Mode:
        if model in self.sources:
            return "in-process"
        if self.render is not None:
            return "render"
        return "approximate"

    async def token_ids(self, model: str, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """vLLM's prompt ids for this request, or None (route approximately). Never raises."""
        source: TokenSource | None = self.sources.get(model) or self.render
        if source is None or endpoint not in TOKEN_ENDPOINTS:
            return None  # count_tokens, embeddings: nothing to key on, and nothing counted
        try:
            ids = await source.prompt_ids(endpoint, body)
        except Exception:  # a source is built not to raise; this keeps a bug from failing a request
            log.exception("token source failed; routing approximately")
            ids = None
        outcome = "exact" if ids is not None else "fallback"
        counts = self.exact if ids is not None else self.fallback
        counts[model] = counts.get(model, 0) + 1
        row = self.by_endpoint.setdefault(model, {}).setdefault(endpoint, {"exact": 0, "fallback": 0})
        row[outcome] += 1
        return ids

    def stats(self, models: list[str]) -> dict[str, Any]:
        """Per model: the mode, and how many requests got exact ids or fell back."""
        names = sorted(set(models) | set(self.sources) | set(self.errors) | set(self.exact) | set(self.fallback))
        out: dict[str, Any] = {}
        for model in names:
            row: dict[str, Any] = {"mode": self.mode(model), "exact": self.exact.get(model, 0),
                                   "fallback": self.fallback.get(model, 0)}
            source = self.sources.get(model)
            if isinstance(source, HFTokenSource):
                row["tokenizer"] = source.tokenizer_dir
                row["offloaded"] = source.offloaded
                if source.cache is not None:
                    row["segment_cache"] = source.cache.stats()
            if model in self.by_endpoint:
                row["endpoints"] = {e: dict(c) for e, c in sorted(self.by_endpoint[model].items())}
            if model in self.errors:
                row["error"] = self.errors[model]
            out[model] = row
        # Which endpoints' requests carry token ids at all (in-process and render alike).
        result: dict[str, Any] = {"endpoints": sorted(TOKEN_ENDPOINTS), "models": out}
        if self.render is not None:
            result["render"] = self.render.stats()
        return result

    def degraded(self) -> list[str]:
        """/readyz lines: what routes approximately that was meant to be exact."""
        out = [] if self.loaded else ["tokenizers loading: routing approximately"]
        out += [f"tokenizer for model {m}: did not load, routing approximately" for m in sorted(self.errors)]
        if self.render is not None and not self.render.healthy:
            out.append("render server unreachable: routing approximately")
        return out

    async def aclose(self) -> None:
        for source in self.sources.values():
            close = getattr(source, "close", None)
            if callable(close):
                close()
        if self.render is not None:
            await self.render.aclose()
