"""The OpenAI request bodies `engram serve` accepts (pydantic models FastAPI validates every request against) and
OpenAI's error body, the one shape every refusal takes.

Strict on purpose: a value of the wrong JSON type is refused, never coerced (`"stream": "false"` is not false,
`true` is not 1, `5.0` is not a token count); numbers are finite and within OpenAI's ranges; seeds fit int64;
stop strings are non-empty; text is valid Unicode (a lone surrogate such as `"\\ud800"` is refused); chat roles
come from a fixed set. Fields the server does not implement (`n` > 1, `best_of`, penalties, `tools`, chat's
`logprobs`, ...) are refused by name (`unimplemented`) rather than silently ignored; other unknown fields are ignored.
`/v1/completions` takes `logprobs` (an int, at most `MAX_LOGPROBS`) and `echo`, and a prompt of token ids as well as
text (as vLLM does: what lm-eval-harness sends); `/tokenize` and `/detokenize` bodies are vLLM's. Both routes take
`top_k`, the extra sampling field vLLM accepts in its OpenAI requests (-1 or 0: every token, vLLM's "off").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic_core import PydanticCustomError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = ("system", "developer", "user", "assistant")  # (no "tool": tools are not implemented)
INT64 = (-(2**63), 2**63 - 1)
MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default --max-logprobs; OpenAI's legacy API allows 5)


def openai_error(status: int, message: str, code: str | None, param: str | None = None,
                 headers: dict | None = None) -> JSONResponse:
    """OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _unicode(s: str) -> str:
    """Refuse a lone surrogate (`"\\ud800"` in JSON, or the raw bytes ED A0 80): not Unicode, no tokenizer takes it."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("invalid_unicode", "the text is not valid Unicode: it has a lone surrogate "
                                  "{char} at position {pos}", {"char": repr(s[e.start]), "pos": e.start}) from None
    return s


def _listed(v):
    return [v] if isinstance(v, str) else v


def _prompts(v):
    """A prompt as OpenAI's legacy API takes it, as a list of prompts: text, [text], [ids] or [[ids]]."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return [v]  # one prompt of token ids
    return v


def _token_count(v: int) -> int:
    if v < 0:
        raise PydanticCustomError("greater_than_equal", "Input should be greater than or equal to 1 (0 with echo: "
                                  "true scores the prompt alone)")
    return v


Text = Annotated[StrictStr, AfterValidator(_unicode)]
TokenId = Annotated[StrictInt, Field(ge=0)]  # (the vocabulary bounds it, checked with the model: `Engine.check_ids`)
Number = Annotated[float, Field(allow_inf_nan=False)]  # (strict: an int is a number, a bool is not)
Stops = Annotated[list[Annotated[StrictStr, Field(min_length=1), AfterValidator(_unicode)]], BeforeValidator(_listed),
                  Field(max_length=4)]


class _Sampling(BaseModel):
    """What both routes share: the model id and the sampling settings."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # (the context bounds it, checked with the prompt)
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None  # 0 (or below 1e-4): greedy
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # (vLLM's extra field; -1 or 0: every token)
    seed: Annotated[StrictInt, Field(ge=INT64[0], le=INT64[1])] | None = None
    stop: Stops | None = None
    stream: StrictBool | None = None
    stream_options: dict | None = None  # ({"include_usage": true}: the last chunk carries usage anyway)
    user: Text | None = None
    # accepted at their do-nothing values only (`unimplemented` names the others)
    n: StrictInt | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: dict | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    response_format: dict | None = None

    def unimplemented(self) -> list[str]:
        """The fields this request sets to something `engram serve` does not do (each would change the answer)."""
        bad = {"n": self.n not in (None, 1), "logprobs": self.logprobs not in (None, False),
               "top_logprobs": self.top_logprobs not in (None, 0), "logit_bias": bool(self.logit_bias),
               "presence_penalty": self.presence_penalty not in (None, 0),
               "frequency_penalty": self.frequency_penalty not in (None, 0),
               "response_format": (self.response_format or {"type": "text"}).get("type") != "text"}
        return [k for k, v in bad.items() if v]


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt (a string or a list of token ids, alone or in a list of one). `logprobs` k:
    each token's log-probability and the k likeliest alternatives; `echo`: the prompt comes back before the
    completion (with `logprobs`, its tokens' log-probabilities too, the first None); `max_tokens` 0 with `echo`
    scores the prompt without decoding (how lm-eval-harness scores a continuation)."""

    prompt: Annotated[list[Text | list[TokenId]], BeforeValidator(_prompts), Field(min_length=1, max_length=1)]
    max_tokens: Annotated[StrictInt, AfterValidator(_token_count)] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: Text | None = None

    def unimplemented(self) -> list[str]:
        done = [k for k in super().unimplemented() if k != "logprobs"]  # (implemented here, an int)
        return done + [k for k, v in {"best_of": self.best_of not in (None, 1),
                                                         "suffix": bool(self.suffix)}.items() if v]


class Message(BaseModel):
    """One chat turn: a role from a fixed set, and text."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal[ROLES]
    content: Text
    name: Text | None = None


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: a conversation, rendered by the model's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # (newer clients' name for max_tokens)
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None

    def unimplemented(self) -> list[str]:
        return super().unimplemented() + [k for k in ("tools", "tool_choice", "functions", "function_call")
                                          if getattr(self, k) not in (None, [], "none")]


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): the ids of `prompt`, with the tokenizer's special tokens (BOS...) if asked."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text | None = None
    prompt: Text
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): the text of token ids."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text | None = None
    tokens: list[TokenId]


OverlayName = Annotated[StrictStr, Field(min_length=1, max_length=200), AfterValidator(_unicode)]


class LoadOverlayRequest(BaseModel):
    """POST /v1/load_overlay (`--allow-overlay-updates`): serve the overlay folder `overlay_path` (on the server's
    machine, as `--overlay NAME=DIR`) as model `MODEL+overlay_name`; vLLM's `/v1/load_lora_adapter` shape
    (`lora_name`, `lora_path`) with overlay names. Also the vLLM plugin's body (`integrations.vllm.routing`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    overlay_name: OverlayName
    overlay_path: Annotated[StrictStr, Field(min_length=1, max_length=4096), AfterValidator(_unicode)]


class UnloadOverlayRequest(BaseModel):
    """POST /v1/unload_overlay: stop serving `MODEL+overlay_name` (the requests admitted before keep it to their
    end); vLLM's `/v1/unload_lora_adapter` shape."""

    model_config = ConfigDict(strict=True, extra="ignore")

    overlay_name: OverlayName
