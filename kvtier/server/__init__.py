"""The OpenAI-compatible HTTP server (`kvtier serve`).

    app.py           FastAPI app: routes, body limits, OpenAI-style errors
    serving.py       OpenAI requests -> engine requests; responses and SSE chunks back
    protocol.py      request models (pydantic) and the error shape
    async_engine.py  old names of kvtier.engine.client's (AsyncEngine: the in-process client)
    engine_proc.py   the engine process's `python -m` entry; old names of kvtier.engine.process's
    metrics.py       Prometheus series from the engine's EngineStats

The engine behind the server is reached only through kvtier.engine.client.EngineClient (built by
kvtier.engine.frontend.make_engine_client).
    tenancy.py       Tenant, resolved per request from the API key (the seam for isolation)

Import `kvtier.server.app` for `build_app` / `run_server`; this package itself imports nothing
heavy.
"""
