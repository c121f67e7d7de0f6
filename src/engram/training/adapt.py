"""`engram adapt`: teach a pretrained transformers causal LM a new corpus with an Engram memory adapter.

    engram adapt --base DIR --data PATH --out RUN [--layers 1,3] [--lora-rank 8] [--method engram]

Methods (what trains; the base model is loaded from DIR, a `save_pretrained` folder with its
`tokenizer.json`, or a model id `org/name[@REVISION]` in the local Hugging Face cache: `engram.inference.hub`):
    engram        Engram layers attached in front of `--layers` (`engram.attach`), base frozen: the tables
                  with the lazy row optimizer (LR x table_lr_mult, no decay), the rest of Engram with AdamW.
    lora          LoRA on the base (PEFT, `engram-torch[peft]`), no Engram.
    lora+engram   both.
    full          full fine-tuning of every base weight, no Engram (the reference point).
`--unfreeze NAME` also trains base modules (e.g. lm_head); they are saved with the adapter.

The run is `engram train`'s (`run.py`): the same run directory, metrics.jsonl, progress bar,
evaluation, table options (`--set table_mode=mmap`, `table_readahead`, `table_init=file`, ...),
checkpoints (trainable parameters only: the base is read from DIR again on `--resume`), Ctrl-C then
`--resume`. RUN/final/ holds the adapter (`engram.save_adapter`: Engram weights, LoRA in `lora/`),
a PEFT folder for `lora`, or a full `save_pretrained` model for `full`; load it with
`engram eval --base DIR --adapter RUN/final` (`engram.inference.load_with_adapter`). The base loads as every
inference path loads it (`engram.inference.load_base`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ..config import ConfigError
from ..distributed.parallel import DistContext
from ..inference import load_base
from ..inference.hub import resolve_model_dir
from ..persist import atomic_write_bytes, new_dir, write_json
from ..tokenizer import TOKENIZER_CONFIG, write_tokenizer_files
from .config import TrainConfig, current_settings
from .data import eval_windows, load_split, prepare
from .presets import ADAPT_METHODS
from .run import building, evaluate, execute, finish_build, open_run

# Adapter training defaults: no weight decay (few steps on a new corpus), fine-tuning LR.
ADAPT_TRAIN = TrainConfig(tokenizer="base", seq_len=256, batch_size=8, max_steps=500, lr=1e-3, warmup_steps=30,
                          weight_decay=0.0, eval_max_windows=64, ckpt_every=100)


def _layers(spec, n_layers: int) -> list[int]:
    """--layers "1,3" -> [1, 3]; None: the second layer (as the paper's first Engram block), or 0 for 1 layer."""
    if spec is None or spec == "":
        return [min(1, n_layers - 1)]
    if isinstance(spec, (list, tuple)):
        return [int(x) for x in spec]
    try:
        return [int(x) for x in str(spec).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--layers {spec}: expected comma-separated layer indices, e.g. 1,3") from None


def _card_training(run, method: str) -> dict:
    """What the adapter's model card shows of this run (`adapters.card`): data, steps, the last train loss and the
    last validation loss (nats per token, from metrics.jsonl), settings."""
    from .run import read_metrics, read_run_file

    recs = read_metrics(run.metrics_path) if run.metrics_path.is_file() else []
    last = recs[-1] if recs else {}
    val = next((r["val_loss"] for r in reversed(recs) if r.get("val_loss") is not None), None)
    t = run.tcfg
    return {"command": "engram adapt", "data": read_run_file(run.run_dir).get("data"), "steps": last.get("step"),
            "train_loss": last.get("train_loss"), "val_loss": val,
            "settings": {"method": method, "lr": t.lr, "batch_size": t.batch_size, "seq_len": t.seq_len}}


EDIT_READY_NOTE = ("rows and the value bias cleared after training (engram.adapters.clear_rows): the model is exactly "
                   "the base until an overlay writes rows; the losses above are the adapter's before clearing")


def _write_final(model, run_dir: Path, method: str, tok_file: Path, training: dict | None = None,
                 edit_ready: bool = False) -> Path:
    from ..adapters import clear_rows, save_adapter

    final = run_dir / "final"
    if method in ("engram", "lora+engram"):
        if edit_ready:  # the trained projections kept, the rows zero: the base's logits until a fact is written
            clear_rows(model)
            training = {**(training or {}), "edit_ready": EDIT_READY_NOTE}
        return save_adapter(model, final, training=training)
    with new_dir(final) as tmp:  # checksums of every file, written last (`engram verify`)
        if method == "full":  # the tokenizer and its EOS (generation stops there, as in `save_final`) ...
            eos = write_tokenizer_files(tmp, tok_file, model.config.pad_token_id)
            own = Path(tok_file).parent / TOKENIZER_CONFIG
            if own.is_file():  # ... unless the base has its own tokenizer config (its EOS, chat template)
                atomic_write_bytes(tmp / TOKENIZER_CONFIG, own.read_bytes())
            elif model.generation_config.eos_token_id is None:
                model.generation_config.eos_token_id = eos
        model.save_pretrained(str(tmp))  # lora: the PEFT adapter folder; full: the whole model
    return final


def _method(method: str, lora_rank: int | None) -> tuple[str, int | None]:
    """(method, LoRA rank) as they run: LoRA methods get rank 8 by default, `--lora-rank` adds LoRA to engram."""
    if method not in ADAPT_METHODS:
        raise ConfigError(f"--method must be one of {', '.join(ADAPT_METHODS)}, got {method!r}")
    if "lora" in method and not lora_rank:
        lora_rank = 8
    if lora_rank and "lora" not in method:
        method = "lora+engram" if method == "engram" else method
        if method == "full":
            raise ConfigError("--lora-rank with --method full: full fine-tuning trains every weight already")
    return method, lora_rank


def build(base, data, out, method: str = "engram", layers=None, lora_rank: int | None = None,
          unfreeze: list[str] | None = None, engram_options: dict | None = None, max_steps: int | None = None,
          overrides: dict | None = None, resume: bool = False, device: str | None = None, progress: bool = True,
          lora_targets: str | list[str] | None = None, edit_ready: bool = False):
    """Settings, data, run dir, model (adapter attached / LoRA / unfrozen) and optimizers of an adapt run.
    `lora_targets`: PEFT's `target_modules` ("all-linear", or names such as ["q_proj", "v_proj"]); None: PEFT's
    default for the architecture (q_proj and v_proj for Llama)."""
    from .. import adapters as ad

    method, lora_rank = _method(method, lora_rank)
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ConfigError("engram adapt runs in one process (use --device cuda for a GPU)")
    overrides = current_settings(overrides or {})  # (old spellings: table_backend=param is table_mode=ram)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown:
        raise ConfigError(f"unknown training settings {sorted(unknown)}")
    tcfg = dataclasses.replace(ADAPT_TRAIN, **overrides)
    if max_steps is not None:
        tcfg = dataclasses.replace(tcfg, max_steps=max_steps)
    tcfg.validate()
    ddp = DistContext(torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    base_dir = resolve_model_dir(base)  # (a model id: its snapshot in the local HF cache, recorded in run.json)
    model, tok_file = load_base(base_dir, ddp.device)
    layer_ids = _layers(layers, len(ad.find_layers(model)[1])) if "engram" in method else []
    torch.manual_seed(tcfg.seed)
    if "engram" in method:
        with building(tcfg):  # (table_init=file: the tables are created as files, never in RAM)
            ad.attach(model, layer_ids, tokenizer=tok_file, verbose=False, **(engram_options or {}))
    if method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        ad.freeze_base(model)
        if unfreeze:
            if "engram" not in method:
                raise ConfigError("--unfreeze needs an Engram adapter (its modules are saved with it)")
            ad.unfreeze(model, unfreeze)
    if lora_targets is not None and not lora_rank:
        raise ConfigError("--lora-targets needs LoRA (--method lora or lora+engram)")
    if lora_rank:
        model = ad.add_lora(model, rank=lora_rank, target_modules=lora_targets)
    tcfg = dataclasses.replace(tcfg, tokenizer=str(tok_file.resolve()))
    run_json = {"kind": "adapt", "base": str(base_dir.resolve()), "method": method, "layers": layer_ids,
                "lora_rank": lora_rank, "unfreeze": list(unfreeze or []), "engram_options": engram_options or {},
                "lora_targets": lora_targets}
    if base_dir != Path(base):  # a model id
        run_json["base_id"] = str(base)  # (as given; "base" is the snapshot folder, so --resume checks its weights)
    run = open_run(tcfg, data, out, run_json, ("base", "method", "layers", "lora_rank", "unfreeze", "engram_options",
                                               "lora_targets"), resume, ddp, progress)
    run.model = model.train()
    run.only_trainable, run.feed_hashes = method != "full", False  # the adapter hashes in its own forward
    run.counts = ad.trainable_summary(model)
    run.n_params, run.n_table = run.counts["total"], run.counts["engram_table"]
    run.write_final = lambda m: _write_final(m, run.run_dir, method, tok_file, _card_training(run, method), edit_ready)
    adapter = ad.adapter_of(model)
    return finish_build(run, resume, adapter.mapping if adapter is not None else None)


def adapt(base, data=None, out="runs/adapt", method: str = "engram", layers=None, lora_rank: int | None = None,
          unfreeze: list[str] | None = None, engram_options: dict | None = None, max_steps: int | None = None,
          overrides: dict | None = None, resume: bool = False, device: str | None = None, progress: bool = True,
          stop_after: int | None = None, extra_eval: dict | None = None,
          lora_targets: str | list[str] | None = None, edit_ready: bool = False) -> dict:
    """Train an adapter on `data` (default: Shakespeare) for the model in `base`; returns a summary dict.

    `edit_ready`: save the adapter *edit-ready* (`adapters.clear_rows` after training: trained projections, zero
    rows), the starting point of fact edits (`engram edit --base --adapter`): the model equals the base until an
    overlay writes rows, so an edit adds only what it writes. The summary's losses are measured before clearing.

    `extra_eval` {name: data sources}: after training, also report the validation loss on those corpora
    (the retrofit experiment measures forgetting on the base's own corpus this way).
    """
    if edit_ready and "engram" not in _method(method, lora_rank)[0]:
        raise ConfigError(f"--edit-ready clears an Engram adapter's rows; --method {method} trains no Engram: drop "
                          "--edit-ready or use --method engram / lora+engram")
    if edit_ready and extra_eval:
        raise ConfigError("extra_eval measures the trained adapter after saving it, and edit_ready clears its rows "
                          "before: measure the trained adapter in a run without edit_ready")
    run = build(base, data, out, method, layers, lora_rank, unfreeze, engram_options, max_steps, overrides, resume,
                device, progress, lora_targets, edit_ready)
    c, how = run.counts, _method(method, lora_rank)[0]
    summary = execute(run, resume, stop_after, lambda r: (
        f"adapt ({how}): {c['trainable'] / 1e6:.3f}M trainable parameters ({c['engram_table'] / 1e6:.3f}M in "
        f"Engram tables, {c['engram_dense'] / 1e6:.3f}M Engram dense, {c['base_trainable'] / 1e6:.3f}M base) of "
        f"{c['total'] / 1e6:.2f}M; train {r.manifest['splits']['train']['tokens']:,} tokens, device {r.ddp.device}"))
    if "final" in summary:
        summary["trainable"] = c
        if extra_eval:
            summary["extra_eval"] = {name: evaluate_on(run.model, srcs, run.tcfg) for name, srcs in extra_eval.items()}
        write_json(run.run_dir / "summary.json", summary)
    return summary


def evaluate_on(model, sources, tcfg: TrainConfig) -> float:
    """Validation loss of `model` on the val split of `sources`, tokenized with the run's tokenizer."""
    d = prepare(sources, tcfg.tokenizer, progress=False)
    windows = eval_windows(load_split(d, "val"), tcfg.seq_len, tcfg.eval_max_windows)
    dev = next(model.parameters()).device
    return evaluate(model, windows, tcfg.batch_size, dev)
