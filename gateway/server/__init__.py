"""Running kvgate: the ``kvgate`` command (``cli``), uvicorn servers on one event loop
(``serve``, with ``protocol``'s header deadline), the worker supervisor (``workers``,
``worker_info``), ``kvgate demo`` with simulated replicas (``demo``) and
``kvgate check`` (``check``)."""
