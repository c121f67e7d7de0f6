"""`engram serve`: Engram models over the OpenAI API, with fact overlays chosen per request.

`engine.py` holds the model, the named overlays and the worker that decodes requests one at a time;
`app.py` is the FastAPI app (routes, streaming, errors) and `serve()`; `schema.py` the request bodies (pydantic)
and OpenAI's error body; `limits.py` the API key, body size and read-time bounds (`defaults.py`: their defaults);
`metrics.py` the Prometheus metrics of `GET /metrics`.
Needs `engram-torch[serve]`.
The model is loaded and prepared by `engram.inference` (any folder kind, a base + adapter; chat templates).
"""

from .engine import Engine, Job, ServeError, load_engine

__all__ = ["Engine", "Job", "ServeError", "load_engine"]
