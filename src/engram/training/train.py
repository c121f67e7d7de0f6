"""`engram train` and the library call `train(...)`: a preset's model on prepared data.

What is train-specific lives here (the model config from a preset, its parameter counts, the final
`save_pretrained` folder); the run itself (run dir, table placement, batcher, loop, checkpoints,
summary) is `run.py`, shared with `engram adapt`.

One run directory holds everything:
    DIR/run.json           model + training config of the run
    DIR/metrics.jsonl      one JSON object per step: step, train_loss, lr, tok_s (+ val_loss on eval steps)
    DIR/checkpoints/step_NNNNNN/   model.safetensors, optim.safetensors, state.json (with file hashes)
    DIR/loss.png           loss curves (matplotlib, if installed)
    DIR/tb/                TensorBoard event files of the same records (--report-to tensorboard: `tracking.py`)
    DIR/final/             save_pretrained output + tokenizer.json and tokenizer_config.json (its EOS;
                           AutoModelForCausalLM/AutoTokenizer-loadable) and
                           engram_manifest.json (size + sha256 of every file, verified on load)

Checkpoints (`checkpoint.py`) are written to a temp folder and renamed, with every file's sha256
in `state.json`; `--resume` falls back to the previous one if the newest is corrupt. Ctrl-C
finishes the step and saves a checkpoint. Resuming restores weights, optimizer moments, the MoE
biases, the data position and the RNG, so the loss curve continues exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..distributed.parallel import DistContext
from ..memory import is_table_key
from ..model import EngramForCausalLM
from ..persist import new_dir
from ..placement import model_device
from ..tables import installed_tables, table_entries, write_safetensors
from ..tables.base import find_tables
from ..tokenizer import write_tokenizer_files
from . import presets
from .data import text_windows
from .run import building, evaluate, execute, finish_build, open_run


# ------------------------------------------------------------------------------------ model building
def build_model_config(preset: str, manifest: dict, use_engram: bool = True, baseline: str | None = None,
                       model_overrides: dict | None = None):
    return presets.model_for(preset, vocab_size=manifest["vocab_size"], pad_id=manifest["pad_id"],
                             tokenizer_file=manifest["tokenizer_file"], use_engram=use_engram, baseline=baseline,
                             overrides=model_overrides)


def evaluate_text(model, tokenizer, data: list[str] | None = None, split: str = "val", seq_len: int = 256,
                  max_windows: int | None = None, batch_size: int = 16) -> tuple[float, int, int]:
    """Mean next-token loss of `model` on a split of `data` (default: Shakespeare), tokenized with `tokenizer`
    (documents separated by `<|endoftext|>` when the tokenizer has it as id 0, as in training).

    Returns (loss in nats/token, tokens scored, windows of `seq_len`).
    """
    windows = text_windows(tokenizer, data, split, seq_len, max_windows)
    return evaluate(model, windows, batch_size, model_device(model)), windows.size, len(windows)


def save_final(model, run_dir: Path, manifest: dict) -> Path:
    """The trained model as RUN/final: save_pretrained + tokenizer.json and tokenizer_config.json (its EOS, which
    generation_config.json gets too: generation stops there), checksummed, swapped in whole."""
    final = run_dir / "final"
    with new_dir(final) as tmp:  # the manifest comes last: after the tables and the tokenizer
        model.generation_config.eos_token_id = write_tokenizer_files(tmp, manifest["tokenizer_file"],
                                                                     model.config.pad_token_id)
        old = dict(model.config.engram)
        model.config.engram = {**old, "tokenizer_name_or_path": "tokenizer.json"}
        try:
            model.save_pretrained(tmp)
        finally:
            model.config.engram = old
        if installed_tables(model):  # tables in files: stream their rows into model.safetensors, a block at a time
            from safetensors import safe_open

            f = tmp / "model.safetensors"
            with safe_open(str(f), framework="pt") as st:
                meta, small = st.metadata(), {k: st.get_tensor(k) for k in st.keys()}
            write_safetensors(f, table_entries(model, small, where=f"save_final: {f}"), meta)
    return final


# ------------------------------------------------------------------------------------ the run
def build(preset: str, data, out, max_steps, use_engram: bool, baseline, resume: bool, device, overrides,
          progress: bool, model_overrides):
    """Settings, data, run dir and the preset's model; then the shared tail (`run.finish_build`)."""
    ddp = DistContext(torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    tcfg = presets.train_config(preset, overrides, max_steps, world=ddp.world)
    run_json = {"kind": "train", "preset": preset, "use_engram": use_engram, "baseline": baseline,
                "model_overrides": model_overrides or {}}
    run = open_run(tcfg, data, out, run_json, ("preset", "use_engram", "baseline", "model_overrides"), resume, ddp,
                   progress)
    torch.manual_seed(tcfg.seed)
    run.mcfg = build_model_config(preset, run.manifest, use_engram=use_engram, baseline=baseline,
                                  model_overrides=model_overrides)
    with building(tcfg):
        run.model = EngramForCausalLM(run.mcfg).to(ddp.device).train()
    tables = [m for _, m in find_tables(run.model)]  # counted before the tables move to files or shards
    run.n_table = sum(m.num_rows * m.embedding_dim for m in tables if m.embedding.weight.requires_grad)  # trained rows
    run.n_params = (sum(p.numel() for n, p in run.model.named_parameters() if not is_table_key(n))
                    + sum(m.num_rows * m.embedding_dim for m in tables))
    run.write_final = lambda model: save_final(model, run.run_dir, run.manifest)
    return finish_build(run, resume, run.model.model.mapping)


def train(preset: str = "cpu-small", data: list[str] | None = None, out: str | os.PathLike = "runs/cpu-small",
          max_steps: int | None = None, use_engram: bool = True, baseline: str | None = None, resume: bool = False,
          device: str | None = None, overrides: dict | None = None, progress: bool = True,
          stop_after: int | None = None, model_overrides: dict | None = None) -> dict:
    """Train a preset on `data` (default: Shakespeare) into run dir `out`; returns a summary dict.

    `stop_after` simulates an interruption (tests): stop and checkpoint after that many steps.
    """
    run = build(preset, data, out, max_steps, use_engram, baseline, resume, device, overrides, progress,
                model_overrides)
    return execute(run, resume, stop_after, lambda r: (
        f"model: {r.n_params / 1e6:.2f}M parameters ({r.n_table / 1e6:.2f}M in Engram tables), "
        f"train {r.manifest['splits']['train']['tokens']:,} tokens, val windows {len(r.val)}, device {r.ddp.device}"))
