"""``dspark serve``: an OpenAI-compatible HTTP server over ``LLMEngine`` (FastAPI + uvicorn).

``app`` (``create_app``: the endpoints), ``protocol`` (the request / response bodies, as vLLM's),
``engine_loop`` (the thread that owns the engine), ``engine_process`` (that thread in its own
process, as ``dspark serve`` runs it), ``text`` (incremental detokenisation and stop
strings), ``metrics`` (Prometheus). Needs the ``serve`` extra: ``pip install "dspark[serve]"``.
"""

from .app import APIError, create_app
from .engine_loop import EngineLoop
from .engine_process import EngineClient, EngineStartError

__all__ = ["APIError", "EngineClient", "EngineLoop", "EngineStartError", "create_app"]
