"""The APIs served beside OpenAI's chat family, each a ``ProxyEndpoint`` subclass in its own package.

``responses`` (OpenAI's Responses API with state affinity and id rewriting),
``messages`` (Anthropic's Messages API) and ``utility`` (vLLM's tokenizer, pooling
and audio routes). Each holds its own body validation and SSE observer; the hot
path (``gateway.proxy``) never branches on which of them it serves.
"""
