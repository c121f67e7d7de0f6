"""Client of an OpenAI-compatible chat server: `engram ask` and `engram crosscheck` (the `api` extra).

Works with any provider that speaks the chat-completions protocol (DeepSeek, OpenAI, gateways,
vLLM, Ollama). Settings: key from `ENGRAM_API_KEY` (fallbacks `OPENAI_API_KEY`,
`TAOTOKEN_API_KEY` as the tutorial names it), base URL and
model from flags or `ENGRAM_BASE_URL` / `ENGRAM_MODEL`; a `.env` file in the working directory
is read if present (real environment variables win). Every failure people hit is turned into one
`ApiError` line that names the cause and the fix; the key never appears in any message.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngramError, install_hint

DEFAULT_BASE_URL = "https://api.deepseek.com/v1"
DEFAULT_MODEL = "deepseek-chat"
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


class ApiError(EngramError, RuntimeError):
    """A diagnosed API failure: one line, cause and fix, key redacted."""


@dataclass
class Settings:
    api_key: str
    base_url: str
    model: str
    note: str | None = None  # e.g. how the base URL was normalized

    def __repr__(self) -> str:  # never leak the key into logs or tracebacks
        return f"Settings(base_url={self.base_url!r}, model={self.model!r}, api_key=***)"


def _dotenv() -> dict:
    p = Path.cwd() / ".env"
    if not p.is_file():
        return {}
    try:
        from dotenv import dotenv_values
    except ImportError:
        raise ApiError(f"a .env file is present but python-dotenv is missing: {install_hint('api')}") from None
    return {k: v for k, v in dotenv_values(p).items() if v is not None}


def normalize_base_url(url: str) -> tuple[str, str | None]:
    """Strip a trailing `/chat/completions` (the SDK appends it) and a doubled `/v1`; returns (url, note)."""
    orig = url.strip()
    u = orig.rstrip("/")
    u = re.sub(r"/chat/completions$", "", u)
    u = re.sub(r"(/v1)+$", "/v1", u)
    note = None if u == orig.rstrip("/") else f"base URL {orig} normalized to {u} (the SDK appends /chat/completions)"
    return u, note


KEY_VARIABLES = ("ENGRAM_API_KEY", "OPENAI_API_KEY", "TAOTOKEN_API_KEY")  # first set wins; the tutorial sets the last


def load_settings(model: str | None = None, base_url: str | None = None) -> Settings:
    env = {**_dotenv(), **os.environ}
    key = next((env[k] for k in KEY_VARIABLES if env.get(k) and env[k].strip()), None)
    if key is None:
        raise ApiError("no API key: set ENGRAM_API_KEY (or OPENAI_API_KEY, or the tutorial's TAOTOKEN_API_KEY) in the "
                       "environment or in ./.env")
    url, note = normalize_base_url(base_url or env.get("ENGRAM_BASE_URL") or DEFAULT_BASE_URL)
    return Settings(api_key=key.strip(), base_url=url, model=model or env.get("ENGRAM_MODEL") or DEFAULT_MODEL,
                    note=note)


def _redact(text: str, key: str) -> str:
    return text.replace(key, "***") if key else text


def _client(s: Settings, timeout: float, retries: int):
    try:
        import openai
    except ImportError:
        raise ApiError(f"the API commands need the openai package: {install_hint('api')}") from None
    return openai, openai.OpenAI(api_key=s.api_key, base_url=s.base_url, timeout=timeout, max_retries=retries)


def _list_models(client) -> list[str]:
    try:
        return sorted(m.id for m in client.models.list())
    except Exception:
        return []


def _raise_if_unknown_model(client, s: Settings) -> None:
    """Turn a 404/400 into 'unknown model' (with the server's list) when GET /models says so."""
    models = _list_models(client)
    if models and s.model not in models:
        raise ApiError(f"model {s.model!r} is not served by {s.base_url}; available: {', '.join(models[:20])} "
                       "(pass --model or set ENGRAM_MODEL)") from None


def chat(messages: list[dict], settings: Settings, timeout: float = 60.0, retries: int = 3, **kw) -> str:
    """One chat completion; returns the reply text or raises a diagnosed `ApiError`."""
    openai, client = _client(settings, timeout, retries)
    s = settings
    try:
        raw = client.chat.completions.with_raw_response.create(model=s.model, messages=messages, **kw)
        body = raw.http_response.text
        resp = raw.parse()
    except openai.AuthenticationError:
        raise ApiError(f"the server at {s.base_url} rejected the API key (HTTP 401): check ENGRAM_API_KEY "
                       "(or OPENAI_API_KEY) for this provider") from None
    except openai.NotFoundError as e:
        _raise_if_unknown_model(client, s)
        msg = _redact(str(getattr(e, "body", None) or e), s.api_key)
        raise ApiError(f"HTTP 404 from {s.base_url}/chat/completions ({msg[:200]}): is the base URL right? "
                       "It should end where the provider's /chat/completions path begins, usually .../v1") from None
    except openai.BadRequestError as e:
        msg = _redact(str(getattr(e, "body", None) or e), s.api_key)
        if "model" in msg.lower():
            _raise_if_unknown_model(client, s)
        raise ApiError(f"the server refused the request (HTTP 400): {msg[:300]}") from None
    except openai.RateLimitError:
        raise ApiError(f"rate limited by {s.base_url} (HTTP 429) after {retries} retries with backoff: "
                       "wait and retry, or raise the provider quota") from None
    except openai.InternalServerError as e:
        raise ApiError(f"server error from {s.base_url} (HTTP {e.status_code}) after {retries} retries with backoff: "
                       "the provider is failing; retry later") from None
    except openai.APITimeoutError:
        raise ApiError(f"no answer from {s.base_url} within {timeout:g} s (timeout): the server is slow or "
                       "unreachable; try --timeout or another base URL") from None
    except openai.APIConnectionError as e:
        proxies = [(v, os.environ[v]) for v in PROXY_VARS if os.environ.get(v)]
        cause = _redact(str(e.__cause__ or e), s.api_key)
        if proxies:
            v, val = proxies[0]
            raise ApiError(f"could not connect to {s.base_url} while {v}={val} is set: the proxy refused or is "
                           f"unreachable ({cause[:120]}); fix the proxy, or unset {v} / add the host to "
                           "NO_PROXY") from None
        raise ApiError(f"could not connect to {s.base_url} ({cause[:160]}): check the URL and your network") from None
    except openai.APIStatusError as e:
        raise ApiError(f"HTTP {e.status_code} from {s.base_url}: {_redact(str(e.body)[:300], s.api_key)}") from None
    choices = getattr(resp, "choices", None)
    if not choices:
        raise ApiError(f"the server's response has no `choices`: {_redact(body[:400], s.api_key)}")
    content = choices[0].message.content if choices[0].message else None
    if content is None:
        raise ApiError(f"the server's first choice has no message content: {_redact(body[:400], s.api_key)}")
    return content


# ------------------------------------------------------------------------------ crosscheck
ENTITY_PROMPT = ("List the named entities (people, places, works, events, animals with names) and the fixed "
                 "multi-word phrases (idioms, set expressions, titles) that appear verbatim in the text. Answer with "
                 'JSON only, no prose: {"entities": ["..."], "phrases": ["..."]}')
STRICT_PROMPT = ("Your previous answer was not valid JSON of the required shape. Reply with exactly one JSON object "
                 'and nothing else: {"entities": [strings], "phrases": [strings]}. Each string must be copied '
                 "verbatim from the text.")


def parse_entities(reply: str) -> list[str] | None:
    """Strings from a model reply of the form {"entities": [...], "phrases": [...]} (code fences allowed)."""
    t = reply.strip()
    t = re.sub(r"^```(?:json)?\s*|\s*```$", "", t)
    try:
        obj = json.loads(t)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not all(isinstance(obj.get(k, []), list) for k in ("entities", "phrases")):
        return None
    items = [*obj.get("entities", []), *obj.get("phrases", [])]
    if not all(isinstance(x, str) for x in items):
        return None
    return [x.strip() for x in items if x.strip()]


def ask_entities(text: str, settings: Settings, **kw) -> list[str]:
    messages = [{"role": "system", "content": ENTITY_PROMPT}, {"role": "user", "content": text}]
    reply = chat(messages, settings, **kw)
    items = parse_entities(reply)
    if items is None:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": STRICT_PROMPT}]
        reply = chat(messages, settings, **kw)
        items = parse_entities(reply)
    if items is None:
        raise ApiError("the model did not return valid entity JSON after a stricter retry; "
                       f"last reply: {reply[:200]!r}")
    return items


def align(text: str, offsets: list[tuple[int, int]], items: list[str]) -> tuple[list[bool], list[bool]]:
    """Per token: (inside an entity/phrase span, ends one). Matches are verbatim, then case-insensitive."""
    inside, ends = [False] * len(offsets), [False] * len(offsets)
    low = text.lower()
    for item in items:
        spans = [m.span() for m in re.finditer(re.escape(item), text)] or \
                [m.span() for m in re.finditer(re.escape(item.lower()), low)]
        for a, b in spans:
            toks = [i for i, (s, e) in enumerate(offsets) if e > a and s < b and e > s]
            for i in toks:
                inside[i] = True
            if toks:
                ends[toks[-1]] = True
    return inside, ends


def crosscheck(text: str, model, tokenizer, settings: Settings, threshold: float = 0.5, **kw) -> dict:
    """Gates of the model (an engram model, or a base with its Engram adapter: `analysis.gates.compute_gates`) vs the
    hosted model's entities: per-token table and precision/recall."""
    import numpy as np

    from ..analysis.gates import compute_gates

    items = ask_entities(text, settings, **kw)
    enc = tokenizer.encode(text, add_special_tokens=False)
    if not enc.ids:
        raise ApiError("TEXT is empty after tokenization")
    gates = {k: g.mean(-1) for k, g in compute_gates(model, tokenizer, text)[1].items()}  # layer -> (T,)
    inside, ends = align(text, enc.offsets, items)
    mean_gate = np.mean(np.stack(list(gates.values())), axis=0)
    pred = mean_gate > threshold
    truth = np.array(ends)
    tp = int((pred & truth).sum())
    rows = [{"token": text[s:e], "gates": {str(l): round(float(g[i]), 4) for l, g in gates.items()},
             "inside": inside[i], "ends": ends[i]} for i, (s, e) in enumerate(enc.offsets)]
    return {"entities": items, "tokens": rows, "threshold": threshold,
            "precision": tp / int(pred.sum()) if pred.sum() else None,
            "recall": tp / int(truth.sum()) if truth.sum() else None}
