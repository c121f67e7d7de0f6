"""The serving engine: one model, named fact overlays, and one worker thread that decodes requests in order.

Requests queue and are decoded one at a time by a single worker thread, so an overlay chosen by one
request is on the tables only while that request decodes: no other request ever sees it, and every
answer equals the same request sent alone (greedy decoding is deterministic; sampling is seeded per
request). On 2 CPU cores the model's own kernels use the cores; interleaving requests would not add
throughput here (`benchmarks/bench_serve.py` measures it). A request whose client went away is
cancelled between two tokens, or before it starts if it is still queued.

The engine also bounds what one request costs before any model work: a prompt longer (in characters) than the
context could hold is refused before it is tokenized (`check_chars`), and chat messages that would forge another
turn in the rendered prompt are refused (`render_chat`).

Overlays loaded and dropped while serving (`load_overlay`, `unload_overlay`: the app's `POST /v1/load_overlay` and
`/v1/unload_overlay`, behind `--allow-overlay-updates` / `ENGRAM_ALLOW_OVERLAY_UPDATES`): a folder is checked as
at startup (`inference.prepare_inference`, against the weights digest taken then) before it is swapped in; a request
holds the `Overlay` it was admitted with (`Job.rows`), so an unload drops the name at once (later requests get the 404
naming the loaded ones) while the requests admitted before decode with it to their last token, and its memory goes
with the last of them.

Over 450 lines on purpose: everything a request meets between the app and the model (its checks, the chat template,
decoding, log-probabilities, the overlays it may name) is one class, `Engine`, which a stand-in engine replaces whole
in the app's tests.

Log-probabilities (`Job.logprobs`, `echo`): log-softmax of the served model's logits in float32 (`token_logprobs`),
with the request's overlay on: a generated token's from the logits `generate` chose it from (before temperature or
top-p, as vLLM reports them), the prompt's from one forward over it (`echo`).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..deprecation import renamed_keywords
from ..errors import EngramError
from ..inference import (
    PLAIN_CHAT_TEMPLATE,
    PLAIN_ROLES,
    chat_renderer,
    load_inference_model,
    model_chat_template,
    prepare_inference,
)
from ..tokenizer import model_eos_id

OVERLAY_UPDATES_ENV = "ENGRAM_ALLOW_OVERLAY_UPDATES"  # as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, for overlays
GREEDY_BELOW = 1e-4  # a temperature under this decodes greedily (sampling's limit as T -> 0; 1e-300 would overflow)


def overlay_updates_allowed(flag: bool | None = None) -> bool:
    """Whether overlays may be loaded and unloaded while serving: `flag` (`--allow-overlay-updates`) when given, else
    the environment's `ENGRAM_ALLOW_OVERLAY_UPDATES` (1/true/yes), as vLLM gates its runtime LoRA endpoints. Off by
    default: whoever can call the endpoints can make the server read any overlay folder its user can read."""
    import os

    if flag is not None:
        return bool(flag)
    return os.environ.get(OVERLAY_UPDATES_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class ServeError(EngramError, ValueError):
    """A request the server refuses: `status` (HTTP) and `code` say why, the message says what to do."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass
class Job:
    """One request: prompt ids, settings, the overlay to decode with, and where its events go."""

    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None
    overlay: str | None
    emit: object  # callable(event: dict), thread-safe (hands events to the request's event loop)
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: none)
    echo: bool = False  # with logprobs: the prompt's tokens' log-probabilities too
    top_k: int | None = None  # sample from the k likeliest tokens (None, -1 or 0: every token, as vLLM's top_k)
    rows: object = None  # the `Overlay` taken at admission (right after `resolve`): an unload leaves it to this job
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


class _Streamer:
    """transformers streamer: receives each new token id from `generate` and turns them into text deltas."""

    def __init__(self, engine: "Engine", job: Job):
        self.engine, self.job = engine, job
        self.first, self.ids, self.sent, self.finish = True, [], 0, None
        self.text = ""

    def put(self, value: torch.Tensor) -> None:
        if self.first:  # generate() hands the prompt over first
            self.first = False
            return
        new = value.reshape(-1).tolist()
        self.ids.extend(int(v) for v in new)
        self.engine.counts["tokens"] += len(new)
        self.text = self.engine.decode(self.ids)
        cut = _first_stop(self.text, self.job.stop)
        if cut is not None:
            self.text, self.finish = self.text[:cut], "stop"
        self._flush(final=self.finish is not None)

    def _flush(self, final: bool) -> None:
        hold = 0 if final else max((len(s) - 1 for s in self.job.stop), default=0)  # a stop may be half-arrived
        safe = len(self.text) - hold
        while not final and safe > self.sent and self.text[safe - 1] == "\ufffd":  # half a UTF-8 character
            safe -= 1
        if safe > self.sent:
            self.job.emit({"type": "delta", "text": self.text[self.sent:safe]})
            self.sent = safe

    def end(self) -> None:
        self._flush(final=True)


def _first_stop(text: str, stops: list[str]) -> int | None:
    at = [text.find(s) for s in stops if s and s in text]
    return min(at) if at else None


class _Stop:
    """StoppingCriteria: the client went away, or a stop string appeared."""

    def __init__(self, job: Job, streamer: _Streamer):
        self.job, self.streamer = job, streamer

    def __call__(self, input_ids, scores, **kwargs):
        done = self.job.cancelled.is_set() or self.streamer.finish is not None
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class Engine:
    """A loaded model behind a queue. `name`: the model id clients send; `overlays`: {name: Overlay}, each
    served as the model id `name+overlay`; `digest`: the weights digest they were checked against (taken before any
    table format conversion; None: taken from the model when a later load needs it)."""

    def __init__(self, model, tokenizer, name: str, overlays: dict | None = None, chat_template: str | None = None,
                 max_context: int | None = None, digest: str | None = None):
        from ..adapters import generation_pad_id
        from ..placement import model_device

        self.model, self.tokenizer, self.name = model.eval(), tokenizer, name
        self.device = model_device(model)  # (where the prompt's ids go: --device)
        self.overlays = dict(overlays or {})  # (replaced whole on a load or unload, never changed in place)
        self.digest = digest
        self.in_use: dict[str, int] = {}  # overlay name -> its requests queued or decoding
        self._lock = threading.Lock()
        self.chat_template = chat_template
        cfg = getattr(model, "config", None)
        self.max_context = int(max_context or getattr(cfg, "max_position_embeddings", 0) or 4096)
        # no token is longer than the vocabulary's longest string (byte-level BPE: one character per byte), so a
        # prompt of more characters than this cannot fit the context, and is refused without tokenizing it
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if hasattr(tokenizer, "get_vocab") else 64
        self.max_prompt_chars = self.max_context * max(longest, 1)
        self.specials = _special_texts(tokenizer)
        self._template = None  # (compiled on first use)
        self.pad_id = generation_pad_id(model)
        self.eos_id = model_eos_id(model, tokenizer)  # (engram.tokenizer: also lm-eval's EngramLM)
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or tokenizer.get_vocab_size(with_added_tokens=True))
        self.jobs: queue.Queue = queue.Queue()
        self.busy = threading.Event()  # a job is decoding
        self.counts = {"done": 0, "cancelled": 0, "failed": 0, "tokens": 0}  # tokens: decoded, all requests
        self.created = int(time.time())
        self._worker = threading.Thread(target=self._run, name="engram-serve", daemon=True)
        self._worker.start()

    # ---- what clients may ask for
    def model_ids(self) -> list[str]:
        return [self.name] + [f"{self.name}+{o}" for o in self.overlays]

    def resolve(self, model_id: str) -> str | None:
        """The overlay a model id asks for (None: the model alone), or a 404 ServeError."""
        if model_id == self.name:
            return None
        base, _, overlay = (model_id or "").partition("+")
        if base != self.name:
            raise ServeError(f"model {model_id!r} does not exist; this server serves {', '.join(self.model_ids())}",
                             404, "model_not_found", "model")
        if overlay not in self.overlays:
            raise ServeError(f"overlay {overlay!r} is not loaded (loaded: {', '.join(self.overlays) or 'none'}); start "
                             "the server with --overlay NAME=DIR (or POST /v1/load_overlay where allowed)", 404,
                             "model_not_found", "model")
        return overlay

    # ---- overlays loaded and dropped while serving
    def load_overlay(self, name: str, folder: str) -> int:
        """Read `folder`, check it against this model as at startup (`inference.prepare_inference`: checksums, hash
        manifest, the startup weights digest, layers) and serve it as `MODEL+name`; returns its rows. Nothing
        changes unless every check passes (ServeError: 400 a taken or bad name, a foreign or corrupt overlay; 404 no
        overlay there). Runs off the event loop: a decode goes on meanwhile."""
        if not name or "+" in name or name != name.strip():
            raise ServeError(f"overlay_name {name!r}: give a non-empty name without '+' or surrounding spaces (it is "
                             "served as MODEL+NAME)", 400, "invalid_value", "overlay_name")
        if name in self.overlays:
            raise ServeError(f"overlay {name!r} is already loaded; unload it first (POST /v1/unload_overlay)", 400,
                             "overlay_exists", "overlay_name")
        try:
            if self.digest is None:  # (no overlay at startup and no table conversion: the model's rows are the saved)
                from ..editing import model_digest

                self.digest = model_digest(self.model)
            o = prepare_inference(self.model, overlays={name: folder}, apply=False, digest=self.digest)[name]
        except FileNotFoundError as e:
            raise ServeError(str(e).splitlines()[0], 404, "overlay_not_found", "overlay_path") from None
        except (EngramError, OSError, ValueError) as e:  # (EditError, IntegrityError, ... : one line each)
            raise ServeError(f"overlay {name!r} refused, nothing changed: {str(e).splitlines()[0]}", 400,
                             "invalid_overlay", "overlay_path") from None
        with self._lock:  # (two loads of one name at once: the first wins)
            if name in self.overlays:
                raise ServeError(f"overlay {name!r} is already loaded; unload it first", 400, "overlay_exists",
                                 "overlay_name")
            self.overlays = {**self.overlays, name: o}
        return o.num_rows

    def unload_overlay(self, name: str) -> int:
        """Stop serving `MODEL+name`: later requests for it get the 404 naming the loaded ones; the requests admitted
        before keep it to their last token (each holds its `Overlay`). Returns how many are still queued or
        decoding with it; 404 ServeError for a name not loaded."""
        with self._lock:
            if name not in self.overlays:
                raise ServeError(f"overlay {name!r} is not loaded (loaded: {', '.join(self.overlays) or 'none'})", 404,
                                 "overlay_not_found", "overlay_name")
            self.overlays = {k: v for k, v in self.overlays.items() if k != name}
            return self.in_use.get(name, 0)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def text_of(self, ids: list[int]) -> str:
        """The text of `ids` with special tokens spelled out (an echoed prompt of ids, `/detokenize`)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's own text (special tokens spelled out): the `tokens` and `top_logprobs` keys of logprobs."""
        return self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        """Refuse token ids the model has no embedding for (a prompt or `/detokenize` given as ids)."""
        bad = next((i for i in ids if i >= self.vocab_size), None)
        if bad is not None:
            raise ServeError(f"token id {bad} is outside this model's vocabulary (ids 0 to {self.vocab_size - 1})",
                             400, "invalid_value", param)

    def tokenizer_info(self) -> dict:
        """What vLLM's `GET /tokenizer_info` answers and lm-eval-harness's remote tokenizer reads: the EOS text
        (the model's generation EOS), no BOS (engram encodes without special tokens), the pad text, the context,
        the chat template."""
        pad = self.tokenizer.id_to_token(self.pad_id) if self.pad_id is not None else None
        return {"tokenizer_class": "tokenizers.Tokenizer", "eos_token": self.tokenizer.id_to_token(self.eos_id),
                "bos_token": None, "pad_token": pad, "model_max_length": self.max_context,
                "chat_template": self.chat_template}

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt for `messages` ({role, content}, roles already from the fixed set), by the chat template
        (a sandboxed Jinja environment, as transformers renders them). Refused (400): a message holding one of
        the tokenizer's special tokens as text, or, with `--chat-template plain`, a line that starts like a turn
        (`assistant: ...`): either would let a client forge a turn the model reads as another speaker's."""
        if not self.chat_template:
            raise ServeError("this model's tokenizer has no chat template (tokenizer_config.json 'chat_template'); "
                             "use /v1/completions with a prompt", 400, "no_chat_template")
        import jinja2

        for i, m in enumerate(messages):
            for key in ("role", "content"):
                special = next((t for t in self.specials if t in m[key]), None)
                if special:
                    raise ServeError(f"messages[{i}].{key} holds the special token {special!r} as text, which would "
                                     "forge a turn in the prompt; remove it", 400, "invalid_value", f"messages.{i}")
            if self.chat_template == PLAIN_CHAT_TEMPLATE:
                for line in m["content"].splitlines()[1:]:
                    head = line.lstrip().partition(":")[0].lower()
                    if ":" in line and head in PLAIN_ROLES:
                        raise ServeError(f"messages[{i}].content has a line starting {head + ':'!r}, which the plain "
                                         "chat template would read as another turn; rephrase or indent it", 400,
                                         "invalid_value", f"messages.{i}.content")
        if self._template is None:
            def refuse(message):
                raise ServeError(f"the chat template refused these messages: {message}", 400, "invalid_value",
                                 "messages")

            self._template = chat_renderer(self.chat_template, refuse)
        try:
            return self._template(messages)
        except jinja2.TemplateError as e:
            raise ServeError(f"the chat template could not render these messages ({type(e).__name__}: {e})", 400,
                             "invalid_value", "messages") from None

    def check_chars(self, n: int, param: str = "prompt") -> None:
        """Refuse a prompt of `n` characters if the context cannot hold them, before tokenizing it (a 50 MB
        prompt would otherwise cost seconds of CPU and gigabytes of memory to count its tokens)."""
        if n > self.max_prompt_chars:
            raise ServeError(f"the prompt has {n:,} characters; this model's context is {self.max_context:,} "
                             f"tokens, at most {self.max_prompt_chars:,} characters", 400, "context_length_exceeded",
                             param)

    def check(self, ids: list[int], max_tokens: int) -> None:
        if not ids:
            raise ServeError("the prompt is empty (no tokens after tokenization); send some text", 400,
                             "empty_prompt", "prompt")
        if len(ids) + 1 > self.max_context:
            raise ServeError(f"the prompt has {len(ids):,} tokens; this model's context is {self.max_context:,}", 400,
                             "context_length_exceeded", "prompt")
        if len(ids) + max_tokens > self.max_context:
            raise ServeError(f"max_tokens {max_tokens:,} + the prompt's {len(ids):,} tokens exceed the context of "
                             f"{self.max_context:,}; ask for at most {self.max_context - len(ids):,}", 400,
                             "context_length_exceeded", "max_tokens")

    def submit(self, job: Job) -> None:
        if job.overlay is not None:
            with self._lock:
                self.in_use[job.overlay] = self.in_use.get(job.overlay, 0) + 1
        self.jobs.put(job)

    def _release(self, job: Job) -> None:
        if job.overlay is not None:
            with self._lock:
                left = self.in_use.get(job.overlay, 0) - 1
                if left > 0:
                    self.in_use[job.overlay] = left
                else:
                    self.in_use.pop(job.overlay, None)
            job.rows = None  # (the last request of an unloaded overlay lets its rows go)

    # ---- the worker
    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.busy.set()
            try:
                self._decode(job)
            except Exception as e:  # a failure ends this request, never the server
                self.counts["failed"] += 1
                job.emit({"type": "error",
                          "message": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            finally:
                self._release(job)
                self.busy.clear()

    def _decode(self, job: Job) -> None:
        from contextlib import nullcontext

        from transformers import StoppingCriteriaList

        if job.cancelled.is_set():
            self.counts["cancelled"] += 1
            job.emit({"type": "done", "finish_reason": "cancelled", "completion_tokens": 0})
            return
        streamer = _Streamer(self, job)
        greedy = job.temperature < GREEDY_BELOW or job.top_p <= 0  # (both limits of sampling are the argmax)
        ctx = nullcontext()
        if job.overlay is not None:
            from ..editing import applied

            ctx = applied(self.model, job.rows if job.rows is not None else self.overlays[job.overlay])
        if job.seed is not None:
            torch.manual_seed(job.seed)
        k, prompt_lp, completion_lp = job.logprobs, None, None
        with ctx, torch.no_grad():
            ids = torch.tensor([job.ids], device=self.device)
            if job.echo and k is not None:  # the prompt's own tokens, from one forward over it
                logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1]  # (T - 1, V): predicts ids[1:]
                prompt_lp = self.logprobs_of(logits, job.ids[1:], k, first=job.ids[0])
            if job.max_tokens > 0:
                out = self.model.generate(ids, max_new_tokens=job.max_tokens, do_sample=not greedy,
                                          temperature=None if greedy else job.temperature,
                                          top_k=None if greedy or not job.top_k or job.top_k < 1 else job.top_k,
                                          top_p=None if greedy or job.top_p >= 1 else job.top_p,
                                          pad_token_id=self.pad_id, streamer=streamer,
                                          stopping_criteria=StoppingCriteriaList([_Stop(job, streamer)]),
                                          return_dict_in_generate=k is not None, output_logits=k is not None)
                if k is not None:  # out.logits: one (1, V) per new token, the raw logits it was chosen from
                    chosen = streamer.ids[:len(out.logits)]
                    logits = torch.cat([x[:1] for x in out.logits[:len(chosen)]]) if chosen else None
                    cut = len(streamer.text) if streamer.finish == "stop" else None
                    completion_lp = self.logprobs_of(logits, chosen, k, text_len=cut)
        reason = streamer.finish or ("cancelled" if job.cancelled.is_set() else
                                     "length" if len(streamer.ids) >= job.max_tokens else "stop")
        self.counts["cancelled" if reason == "cancelled" else "done"] += 1
        job.emit({"type": "done", "finish_reason": reason, "completion_tokens": len(streamer.ids),
                  "prompt_logprobs": prompt_lp, "logprobs": completion_lp})

    def logprobs_of(self, logits: torch.Tensor | None, chosen: list[int], k: int, first: int | None = None,
                    text_len: int | None = None) -> dict:
        """OpenAI's legacy `logprobs` (tokens, token_logprobs, top_logprobs; the app adds text_offset) of the tokens
        `chosen`, `logits` (len(chosen), V) being the logits each was predicted from. `first`: a prompt's first
        token, listed first with no log-probability (nothing predicts it). `text_len`: the returned text's length
        when a stop string cut it: tokens starting at or past it are dropped, as their text is not returned."""
        lp, top = token_logprobs(logits, chosen, k) if chosen else ([], [])
        ids = ([first] if first is not None else []) + list(chosen)
        strings = self.token_strings(ids)
        names = dict(zip(ids, strings))
        others = list({i for row in top for i, _ in row} - set(names))
        names.update(zip(others, self.token_strings(others)))
        tops = []
        for row in top:  # (two ids of one text, e.g. byte tokens shown as "\ufffd", keep the likelier's value)
            tops.append({})
            for i, v in row:
                tops[-1].setdefault(names[i], v)
        out = {"tokens": strings, "token_logprobs": ([None] if first is not None else []) + lp,
               "top_logprobs": ([None] if first is not None else []) + tops}
        if text_len is not None:
            starts = [sum(map(len, strings[:j])) for j in range(len(strings))]
            keep = sum(1 for at in starts if at < text_len) if text_len < sum(map(len, strings)) else len(strings)
            out = {key: v[:keep] for key, v in out.items()}
        return out

    def close(self) -> None:
        self.jobs.put(None)
        self._worker.join(timeout=5)


@renamed_keywords(table_backend="table_tier")
def load_engine(path=None, base=None, adapter=None, overlays: dict | None = None, table_tier: str = "ram",
                table_format: str | None = None, table_dir=None, name: str | None = None,
                chat_template: str | None = None, dtype=None, device=None) -> Engine:
    """An `Engine` for a model folder of any kind (`path`: a run dir, an engram model folder, a qwen4_exp folder, as
    `inference.load_inference_model`) or a pretrained base + adapter;
    `overlays` {name: folder}, each checked against the model as `engram sample --overlay` does. `chat_template`:
    "plain", a Jinja file, or None (the tokenizer's own, from tokenizer_config.json, if it has one). `table_tier`
    (`table_backend=`: its deprecated spelling), `table_dir`, `dtype`, `device`: as `load_inference_model`."""
    model, tok = load_inference_model(path, base, adapter, table_tier, table_dir, dtype=dtype, device=device)
    template = model_chat_template(path, base)
    if base is not None:
        name = name or Path(adapter or base).name
    else:
        p = Path(path)
        name = name or (p.name if p.name != "final" else p.parent.name)
    if chat_template == "plain":
        template = PLAIN_CHAT_TEMPLATE
    elif chat_template is not None:
        f = Path(chat_template)
        if not f.is_file():
            raise ServeError(f"--chat-template {chat_template}: no such file (give 'plain' or a Jinja template file)")
        template = f.read_text(encoding="utf-8")
    # (the tier was set by the loader; overlays checked before the format conversion, chosen per request). The
    # digest is kept for overlays loaded while serving: taken now if a conversion would change the rows it samples
    digest = None
    if overlays or (table_format and table_format != "float32"):
        from ..editing import model_digest

        digest = model_digest(model)
    loaded = prepare_inference(model, table_format=table_format, overlays=overlays, apply=False, digest=digest)
    return Engine(model, tok, name, loaded, template, digest=digest)


def token_logprobs(logits: torch.Tensor, chosen: list[int], k: int) -> tuple[list[float], list[list[tuple]]]:
    """Log-softmax of `logits` (n, V) in float32: the log-probability of each `chosen` token (n ids), and each row's
    `k` likeliest (id, log-probability) pairs plus the chosen one (OpenAI's "up to logprobs + 1"). Rows are taken
    256 at a time, so a long prompt's float32 copy of its logits stays small."""
    lps, tops = [], []
    want = torch.tensor(chosen, device=logits.device)
    for a in range(0, logits.shape[0], 256):
        lp = torch.log_softmax(logits[a:a + 256].float(), dim=-1)  # (rows, V)
        picked = lp.gather(1, want[a:a + 256, None])[:, 0]
        lps += picked.tolist()
        if k > 0:
            v, i = lp.topk(k, dim=-1)
            tops += [list(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
        else:
            tops += [[] for _ in range(lp.shape[0])]
    return lps, [row + [(c, p)] for row, c, p in zip(tops, chosen, lps)]


def _special_texts(tokenizer) -> list[str]:
    """The text of the tokenizer's special tokens (`<|im_start|>`, ...): typed into a message, they would be
    tokenized as the real token."""
    try:
        added = tokenizer.get_added_tokens_decoder().values()
    except AttributeError:
        return []
    return [t.content for t in added if getattr(t, "special", False) and t.content]
