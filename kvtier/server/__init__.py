"""The OpenAI-compatible HTTP server (`kvtier serve`).

    app.py           FastAPI app: routes, body limits, OpenAI-style errors
    serving.py       OpenAI requests -> engine requests; responses and SSE chunks back
    protocol.py      request models (pydantic) and the error shape
    async_engine.py  the engine thread: owns EngineCore, steps it, hands outputs to asyncio
    metrics.py       Prometheus series from the engine's stats dataclasses
    tenancy.py       Tenant, resolved per request from the API key (the seam for isolation)

Import `kvtier.server.app` for `build_app` / `run_server`; this package itself imports nothing
heavy.
"""
