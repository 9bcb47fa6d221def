"""vLLM's utility, pooling and audio routes: the endpoints (``routes``), body checks
(``validate``) and the multipart reader for audio uploads (``multipart``)."""
