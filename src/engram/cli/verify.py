"""`engram verify PATH`: check a run, model, adapter, overlay or checkpoint folder against its checksums.

Kept apart from `persist.py` (the core, which the model file imports) because it reads every kind of folder
engram writes: adapters, checkpoints, run directories; an application over every package, so it sits beside the
command that runs it (`model.py`).
"""

from __future__ import annotations

from pathlib import Path

from ..persist import MANIFEST, UnverifiedWarning, verify_manifest


def verify_path(path) -> list[tuple[str, str, str]]:
    """Check what lives at `path` (a run dir, a saved model, an adapter, a checkpoint): [(what, status, detail)]
    with status "ok", "unverified" (saved before manifests) or "BAD" (detail says what and how to repair)."""
    import warnings as _w

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or folder")
    out: list[tuple[str, str, str]] = []

    def check(what: str, fn, fix: str) -> None:
        try:
            with _w.catch_warnings():
                _w.simplefilter("error", UnverifiedWarning)
                fn()
            out.append((what, "ok", ""))
        except UnverifiedWarning as e:
            out.append((what, "unverified", str(e)))
        except (ValueError, OSError) as e:
            out.append((what, "BAD", f"{str(e).splitlines()[0]}; {fix}" if fix else str(e).splitlines()[0]))

    if (p / "engram_adapter.json").is_file():
        from ..adapters import read_adapter_config

        check(f"adapter {p}", lambda: read_adapter_config(p), "save the adapter again or re-download it")
    elif (p / "overlay.json").is_file():
        from ..editing import Overlay

        check(f"overlay {p}", lambda: Overlay.load(p), "")
    elif (p / "state.json").is_file():
        from ..training.checkpoint import read_checkpoint

        check(f"checkpoint {p}", lambda: read_checkpoint(p),
              "resume from the previous checkpoint (--resume falls back)")
    elif (p / MANIFEST).is_file() or (p / "config.json").is_file():
        check(f"model {p}", lambda: verify_manifest(p), "")
    if (p / "final").is_dir():
        try:
            out += verify_path(p / "final")
        except ValueError:  # a folder another tool wrote (e.g. an older PEFT-only run): nothing to check it against
            out.append((f"final {p / 'final'}", "unverified", "no engram checksums in it"))
    for f in sorted(p.glob("*.safetensors")) if p.is_dir() else []:
        if f.name.startswith("engram_table_") or (f.parent / (f.name + ".blocks")).is_file():
            check(f"table {f}", lambda f=f: _verify_table(f), "")
    if (p / "tables").is_dir():
        out += verify_path(p / "tables")
    ck = p / "checkpoints"
    for d in sorted(ck.glob("step_*")) if ck.is_dir() else []:
        out += verify_path(d)
    if not out:
        raise ValueError(f"{p}: nothing engram saved here (no model, adapter, overlay, table, checkpoint or run "
                         "directory)")
    return out


def _verify_table(path: Path) -> None:
    """Every block of a table file against its block checksums (one warning when it has none)."""
    from ..tables.blocks import BlockVerifier

    v = BlockVerifier.open(path)
    if v is not None:
        v.verify_all()


def write_missing_block_sums(path) -> list[Path]:
    """Add block checksums to every table file under `path` that has none (`engram verify --write-blocks`)."""
    from ..tables.blocks import sidecar, write_block_sums

    p = Path(path)
    files = [p] if p.is_file() else sorted(p.rglob("engram_table_*.safetensors"))
    return [write_block_sums(f) for f in files if not sidecar(f).is_file()]
