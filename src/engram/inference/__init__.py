"""From a folder to a model ready for inference: the one home of loading, adapters at load, `prepare_inference`
and chat templates.

    model, tok = load_inference_model("runs/tiny", table_tier="disk", table_dir="tables")   # any folder kind
    model, tok = load_inference_model(base="bases/llama", adapter="runs/adapt")             # base + adapter/LoRA
    prepare_inference(model, table_format="int8", overlays={"fix": "edits/fix"})            # tier, overlays, format

What a folder can be:
- an engram model: a run dir (its final/) or a save_pretrained folder (`model.load_model`);
- a pretrained transformers base (`load_base`) with an Engram adapter or a PEFT LoRA (`load_with_adapter`);
  a base imported from a GGUF file (`integrations.gguf_bases`) is such a folder;
- a kind another package declares in the entry-point group `engram.folder_kinds` (`kinds.py`): a released
  model's checkpoint (qwen4_exp: its n-gram tables served by engram, in their tier as they load).

Why here, as its own package: every inference path loads the same way (the CLI's `sample`, `eval`, `edit`,
`engram serve`, the vLLM models, `engram adapt`'s base, the experiments), so the loading sits *below* all of them
(`serving`, `integrations`, `training`, `cli`, `engram_experiments`) and *above* what it puts together (the core's
`model`, `adapters`, `editing`'s overlays, `tables`' tiers and formats). It never imports an integration: the
integrations register their folder kinds through the entry-point group, so the layers stay one-way (serving and
integrations, which used to import each other to load a model, both import this instead).

Modules: `load.py` (`load_inference_model`, `load_base`, `load_with_adapter`), `kinds.py` (`FolderKind`, the
registry), `prepare.py` (`prepare_inference`: tier, overlays, format, in one order), `chat.py` (chat templates),
`hub.py` (model ids: `org/name[@REVISION]` -> its snapshot in the local Hugging Face cache, never the network).
Heavy imports (transformers, peft, jinja2) happen inside the functions that need them.
"""

from .chat import (
    PLAIN_CHAT_TEMPLATE,
    PLAIN_ROLES,
    ChatTemplateError,
    chat_renderer,
    chat_template_of,
    model_chat_template,
)
from .hub import ModelIdError, resolve_model_dir
from .kinds import ENTRY_POINTS, FolderKind, UnknownFolderError, find_folder_kind, folder_kinds
from .load import load_base, load_inference_model, load_with_adapter
from .prepare import prepare_inference

__all__ = ["ENTRY_POINTS", "PLAIN_CHAT_TEMPLATE", "PLAIN_ROLES", "ChatTemplateError", "FolderKind", "ModelIdError",
           "UnknownFolderError", "resolve_model_dir", "chat_renderer", "chat_template_of", "find_folder_kind",
           "folder_kinds", "load_base", "load_inference_model", "load_with_adapter", "model_chat_template",
           "prepare_inference"]
