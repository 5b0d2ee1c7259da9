"""An OpenAI-compatible server on the engine (``moetide serve``).

``loop``: the one thread that owns the ``Engine`` and steps it continuously; requests join and leave between
steps through the engine's incremental API, so the core scheduler batches them continuously. ``protocol``: the
request bodies and error bodies (vLLM's and OpenAI's shapes). ``text``: detokenizing and stop strings per choice.
``metrics``: ``/metrics`` in Prometheus text under vLLM's metric names, plus moetide's own. ``app``: the FastAPI
routes. Imported only when the verb runs (FastAPI, uvicorn and torch are optional dependencies).
"""
