"""`engram serve`'s bounds per connection, by default: `limits.py` applies them, `app.serve` and `engram serve`'s
options (`cli/serve.py`) default to them. Constants alone, so the CLI reads them without FastAPI or uvicorn."""

SERVE_MAX_BODY = 1 << 20  # bytes: a prompt of ~1M characters; a model's whole context is rarely a tenth of it
SERVE_READ_TIMEOUT = 30.0  # seconds to send a request's head, and again its body
SERVE_SHUTDOWN_TIMEOUT = 30.0  # seconds in-flight requests get to finish after SIGTERM
