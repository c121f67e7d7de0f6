"""An edit's checkpoint: what makes two edits the same edit, and its state written aside and read back, so an edit
of thousands of facts that runs for hours resumes where it stopped (`edit_facts(checkpoint=...)`)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch

from .facts import EditError, Fact


def edit_key(digest: str, facts: list[Fact], rows: dict, settings: dict) -> str:
    """What makes two edits the same edit (so a checkpoint may resume it): the model, the facts, the rows, the
    settings."""
    h = hashlib.sha256(json.dumps([digest, [f.__dict__ for f in facts], settings], sort_keys=True,
                                  default=str).encode())
    for lid in sorted(rows):
        h.update(rows[lid].numpy().tobytes())
    return h.hexdigest()


def save_checkpoint(path, key: str, step: int, values: dict, opt, log: list, seconds: float) -> None:
    """The edit's state after `step` steps, written aside and swapped in (a crash leaves the old or the new)."""
    from ..persist import atomic_write_bytes

    buf = io.BytesIO()
    torch.save({"key": key, "step": step, "values": {lid: v.detach() for lid, v in values.items()},
                "opt": opt.state_dict(), "log": log, "seconds": seconds}, buf)
    atomic_write_bytes(Path(path), buf.getvalue())


def resume(path, key: str, values: dict, opt) -> tuple[int, list, float]:
    """(first step to run, loss log so far, seconds spent so far): from the checkpoint at `path` when there is one,
    else (1, [], 0.0)."""
    if path is None or not Path(path).is_file():
        return 1, [], 0.0
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn or foreign file: name it, do not guess
        raise EditError(f"cannot read the edit checkpoint {path} ({e}); delete it to start the edit over") from None
    if not isinstance(state, dict) or state.get("key") != key:
        raise EditError(f"the edit checkpoint {path} belongs to another edit (model, facts or settings differ); "
                        "delete it or pass another checkpoint path")
    with torch.no_grad():
        for lid, v in values.items():
            v.copy_(state["values"][lid])
    opt.load_state_dict(state["opt"])
    return state["step"] + 1, list(state["log"]), float(state["seconds"])
