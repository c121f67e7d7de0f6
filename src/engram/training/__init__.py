"""Training: one run in units (`run.py`: run dir, table placement, batcher, loop, checkpoints, summary), driven by
`engram train` (`train.py`: a preset's model) and `engram adapt` (`adapt.py`: a base with an adapter or LoRA), the
optimizers (`optim.py`: lazy row Adam for tables; `hf.py`: `engram.hf_optimizers`, the optimizer argument of
transformers.Trainer / TRL), atomic checkpoints loadable at any world size (`checkpoint.py`),
corpora (`corpora.py`), token files and the resumable batcher (`data.py`), the presets, and `--nproc`
(`launch.py`: relaunch under torchrun).

Nothing in the core (config, tokenizer, hashing, memory, hyper, model) imports from here, nor do `adapters` or
`inference` (an adapt run's base loads through `engram.inference.load_base`).
"""
