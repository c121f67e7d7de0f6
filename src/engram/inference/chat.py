"""Chat templates: which one a model folder carries, engram's plain one, and the one way engram renders them.

`engram serve` (`serving.engine.Engine.render_chat`), `engram edit --chat` (`cli.edit`) and the vLLM launcher
(`--chat-template plain`) read them here.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import EngramError
from ..persist import read_json

# `--chat-template plain`: for models trained without one (engram's own): "role: content" lines, then "assistant:"
PLAIN_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # (what a line must not start with)
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


class ChatTemplateError(EngramError, ValueError):
    """A model folder's chat template cannot be read; the message says what to do."""


def chat_renderer(template: str, refuse):
    """`render(messages) -> prompt` for a chat template (Jinja, sandboxed, as transformers renders them; the
    generation prompt added, bos/eos as empty text since the tokenizer adds no special tokens to a prompt).
    `refuse(message)`: what the template's `raise_exception` calls. The one way engram renders chat prompts:
    `engram serve` and `engram edit --chat` share it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = refuse
    compiled = env.from_string(template)
    return lambda messages: compiled.render(messages=messages, add_generation_prompt=True, bos_token="",
                                            eos_token="")


def model_chat_template(path=None, base=None) -> str | None:
    """The chat template of what `load_inference_model(path, base, ...)` loads: the base folder's, else the model
    folder's (a run dir's `final/` when the folder itself holds no tokenizer_config.json). None when it has none."""
    if base is not None:
        from .hub import resolve_model_dir

        return chat_template_of(resolve_model_dir(base))
    p = Path(path)
    return chat_template_of(p if (p / "tokenizer_config.json").is_file() else p / "final")


def chat_template_of(d: Path) -> str | None:
    """The chat template of the model folder `d`: `chat_template.jinja` (where transformers >= 4.43 saves it), else
    `tokenizer_config.json`'s `chat_template` (None when it has none)."""
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    f = d / "tokenizer_config.json"
    if not f.is_file():
        return None
    t = read_json(f, "tokenizer config", "re-save or re-download the model, or pass --chat-template plain or a "
                  "Jinja file", ChatTemplateError).get("chat_template")
    return t if isinstance(t, str) else None
