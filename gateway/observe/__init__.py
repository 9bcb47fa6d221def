"""What kvgate tells operators about itself: Prometheus metrics (``metrics``), OTLP
traces (``tracing``), JSON logs (``logs``), the status page's trend lines
(``trends``) and its per-tenant and per-endpoint tables (``stats``,
``endpoint_stats``)."""
