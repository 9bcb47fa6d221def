"""The hot path: one request from the client's bytes to the replica's and back.

``endpoint`` (``ProxyEndpoint``: parse, admit, route, forward, relay, account) over
``context`` and ``stages`` (tenant policy, the semantic cache, accounting), ``validate``
(OpenAI bodies), ``upstream`` (pick a replica and open the call, retrying), ``pool``
(replicas, health, leases), ``transport`` (the lean HTTP/1.1 client), ``first_event``
(a stream's first event, awaited inside the retry loop), ``relay`` and ``sse`` (the
answer passed through while it is observed) and ``asgi_io`` (the
client's side of the wire). Nothing here knows any API but OpenAI's chat family:
each other API subclasses ``ProxyEndpoint`` in ``gateway.apis``.
"""
