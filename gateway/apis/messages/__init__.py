"""Anthropic's Messages API: the endpoint (``endpoint``), its error shape (``shape``), body
and header checks (``validate``) and the stream's events (``sse``)."""
