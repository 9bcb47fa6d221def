"""OpenAI's Responses API: the endpoint (``endpoint``), the stored-response routes (``routes``),
the stream's events (``sse``), body checks (``validate``) and kvgate's signed response ids (``ids``)."""
