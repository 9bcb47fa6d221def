"""The admin side: the token-protected admin API (``api``) and its bodies (``bodies``),
OpenAPI document (``openapi``) and tenant routes (``tenants``), a change passed to
every worker (``fanout``), a routing decision explained (``explain``), the operator
actions and views over a running gateway (``operations``: status, readiness, purge,
reload, replicas, routing), and the status page (``static/``)."""
