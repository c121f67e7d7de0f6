"""`engram serve`: Engram models over the OpenAI API, with fact overlays chosen per request.

`engine.py` holds the model, the named overlays and the worker that decodes requests one at a time;
`app.py` is the FastAPI app (routes, streaming, auth, errors) and `serve()`. Needs `engram-torch[serve]`.
"""

from .engine import Engine, Job, ServeError, load_engine

__all__ = ["Engine", "Job", "ServeError", "load_engine"]
