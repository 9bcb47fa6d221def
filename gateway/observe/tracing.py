"""OpenTelemetry traces: one span per proxied request, exported over OTLP when configured.

The span is recorded when the request ends (start time back-dated), so the hot
path pays nothing while tracing is off and one span creation while it is on.
Attributes carry the tenant, model, replica, cache status, token counts and
time to first token; never prompt text, never a key. The provider belongs to
the runtime, not the process-global OTel API, so several gateways in one
process (tests) do not share spans.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode


class Tracing:
    def __init__(self, *, otlp_endpoint: str | None, service_name: str = "kvgate",
                 exporter: SpanExporter | None = None) -> None:
        self.provider: TracerProvider | None = None
        if exporter is None and otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
            processor: Any = BatchSpanProcessor(exporter)
        elif exporter is not None:
            processor = SimpleSpanProcessor(exporter)
        else:
            return
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvgate")

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def record(self, name: str, started_perf: float, attributes: dict[str, Any], error: bool) -> None:
        if self.provider is None:
            return
        elapsed = time.perf_counter() - started_perf
        end_ns = time.time_ns()
        start_ns = end_ns - int(elapsed * 1e9)
        span = self.tracer.start_span(name, kind=SpanKind.SERVER, start_time=start_ns,
                                      attributes={k: v for k, v in attributes.items() if v is not None})
        if error:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
