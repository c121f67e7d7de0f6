"""Model ids where a base model folder is accepted: `org/name` (or `org/name@REVISION`) resolved to its snapshot
folder in the local Hugging Face cache, never over the network.

    resolve_model_dir("bases/llama")                        # an existing folder: itself
    resolve_model_dir("HuggingFaceTB/SmolLM2-135M")          # the snapshot refs/main names in the hub cache
    resolve_model_dir("HuggingFaceTB/SmolLM2-135M@v1.0")     # a branch, tag or 40-hex commit (or revision="v1.0")

The one home of this rule: `load_base` calls it, so every loader (`load_with_adapter`, `load_inference_model`), every
command's `--base` and `engram adapt`'s base take an id. The cache is the one `hf download` (huggingface_hub's
CLI) fills: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (read when called, so a changed
environment counts); huggingface_hub (installed with transformers) finds the snapshot with `local_files_only=True`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import EngramError


class ModelIdError(EngramError, FileNotFoundError):
    """A model id that is not in the local Hugging Face cache (or a revision given with a local folder)."""


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, as huggingface_hub chooses it ($HF_HUB_CACHE, the legacy
    $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub), read from the
    environment now rather than when huggingface_hub was imported."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def split_model_id(spec: str) -> tuple[str, str | None] | None:
    """("org/name", revision or None) of "org/name" / "org/name@REVISION"; None when `spec` is not shaped like a
    Hugging Face model id (one slash, valid repo name characters: huggingface_hub's own check)."""
    repo, _, revision = str(spec).partition("@")
    if repo.count("/") != 1 or (_ and not revision):
        return None
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # (no huggingface_hub: nothing is an id; the caller's "no model here" stands)
        return None
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo, revision or None


def resolve_model_dir(spec: str | os.PathLike, revision: str | None = None, what: str = "--base") -> Path:
    """The folder of `spec`: an existing path as it is, else the local Hugging Face cache's snapshot of the model id
    `spec` ("org/name", "org/name@REVISION"; `revision`: a branch, tag or commit, as transformers' `revision=`).
    Anything else comes back as a Path for the caller to refuse ("no model here"). A model id missing from the
    cache is a one-line `ModelIdError` naming the id, the cache searched and the fix; `what` names the option in it."""
    p = Path(spec)
    if p.exists():
        if revision is not None:
            raise ModelIdError(f"{what} {spec}: revision={revision!r} selects a version of a model id, and {spec} is "
                               "a local folder; leave the revision out or give the id")
        return p
    parsed = split_model_id(str(spec))
    if parsed is None:
        return p
    repo, rev = parsed
    if rev is not None and revision is not None and rev != revision:
        raise ModelIdError(f"{what} {spec}: the id names revision {rev!r} and revision={revision!r} another; give one")
    rev = rev or revision
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        at = f" at revision {rev}" if rev else ""
        flag = f" --revision {rev}" if rev else ""
        raise ModelIdError(f"{what} {spec}: no local folder of that name, and model id {repo}{at} is not in the local "
                           f"Hugging Face cache {cache} (set HF_HUB_CACHE or HF_HOME to another); fetch it with "
                           f"`hf download {repo}{flag}` where the Hub is reachable (then copy that cache here), or "
                           "give a local save_pretrained folder") from None
