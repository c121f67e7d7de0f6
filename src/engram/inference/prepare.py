"""The one path from a loaded model to an inference model: tier, format, overlays, in one order.

Every inference path takes it: the CLI (`engram sample`, `eval`, `edit`: `cli.options.with_overlays`), `engram
serve` (`serving.engine.load_engine`) and the vLLM models (`integrations.vllm.model`, `.adapter_model`). The order
matters, and written three times it diverged:

1. the tables move to their tier (`offload_tables`: RAM, memory-mapped files or the disk tier), unless the
   loader put them there already (a qwen4_exp folder's tables are opened in their tier as they load);
2. the overlays are read and checked against the model (`check_overlay`): its hash family, hash manifest and the
   weights digest, taken *before* any format conversion: an overlay was optimized on the rows as saved, and the
   digest of int8 rows is another model's (tier moves leave the digest as it was: rows are read through the
   table). An engine that builds its own module passes the digest of the checkpoint (`checkpoint_digest`);
3. the tables are converted to `table_format`, reading the rows through their tier (`tables.quant`);
4. the overlays are applied in front of the converted tables (at load), or handed back to be chosen per request.
"""

from __future__ import annotations


def prepare_inference(model, tier: str | None = None, table_dir=None, table_format: str | None = None,
                      overlays: dict | None = None, apply: bool = True, digest: str | None = None) -> dict:
    """Make a loaded `model` an inference model (see the module doc for the order). `tier`: "ram" (or None: leave
    the tables where they are), "mmap" or "disk" with `table_dir`; `table_format`: `tables.quant.TABLE_FORMATS`;
    `overlays`: {name: folder}; `apply`: stack them in order in front of the tables (later ones win on shared
    rows), else only check them; `digest`: the weights digest to check them against (default `model_digest`).
    Returns {name: Overlay}, checked."""
    if tier not in (None, "ram"):
        from ..tables import offload_tables

        offload_tables(model, tier, table_dir)
    loaded = {}
    if overlays:
        from ..editing import EditError, Overlay, check_overlay, model_digest

        loaded = {name: Overlay.load(d) for name, d in overlays.items()}
        digest = digest or model_digest(model)  # (once for all overlays: it hashes every dense weight)
        for name, o in loaded.items():
            d = str(overlays[name])
            try:
                check_overlay(model, o, where=d if name == d else f"--overlay {name}={d}", digest=digest)
            except EditError as e:
                cast = getattr(model, "engram_cast_to", None)  # (`placement.place`: --dtype)
                if cast is None or o.meta.get("base_digest") == digest:
                    raise
                raise EditError(f"{e} (or made in another dtype: this model's dense weights were cast to {cast} "
                                f"at load, --dtype {cast}, and an overlay fits the weights it was optimized on; "
                                "apply it in the dtype it was made in)") from None
    if table_format and table_format != "float32":
        from ..tables.quant import set_table_format

        set_table_format(model, table_format)
    if apply and loaded:
        from ..editing import apply_overlay

        for o in loaded.values():
            apply_overlay(model, o, check=False)
    return loaded


def overlay_spec(spec) -> tuple[str | None, str]:
    """One `--overlay` value, `[NAME=]DIR`, as (NAME or None, DIR): the one reading of it (`engram serve`, `sample`,
    `eval`, `edit` through `cli.options.overlay_dirs`; `engram serve --engine vllm` through its launcher). An existing
    path is a DIR even with a '=' in it; a name has no '+' (a server's model id MODEL+NAME names an overlay); anything
    else is a one-line ValueError."""
    from pathlib import Path

    spec = str(spec)
    name, sep, d = spec.partition("=")
    if not sep or Path(spec).exists():
        return None, spec
    if not name or not d or "+" in name:
        raise ValueError(f"--overlay {spec!r}: expected [NAME=]DIR (a name without '+')")
    return name, d

