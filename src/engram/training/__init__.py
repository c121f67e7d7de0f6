"""Training: the trainer in units (`train.py`), `engram adapt` runs on the same loop (`adapt.py`), the
optimizers (`optim.py`: lazy row Adam for tables), atomic checkpoints loadable at any world size
(`checkpoint.py`), corpora, token files and the resumable batcher (`data.py`), and the presets.

Nothing in the core (config, tokenizer, hashing, memory, hyper, model) imports from here.
"""
