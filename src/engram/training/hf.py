"""An attached model in the Hugging Face training stack: `transformers.Trainer`, TRL's `SFTTrainer`, accelerate.

    engram.attach(model, layer_ids=[1], tokenizer="path/to/base")
    args = TrainingArguments("out", learning_rate=1e-3, ...)          # defaults as they are: max_grad_norm=1.0 ...
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=engram.hf_optimizers(model, args))
    trainer.train()                         # gradient accumulation, save_steps checkpoints, resume_from_checkpoint
    trainer.save_model("out/adapter")       # the adapter (model.save_pretrained), not the base
    model = engram.load_adapter(AutoModelForCausalLM.from_pretrained("path/to/base"), "out/adapter")  # from_pretrained

What makes it work, and where it lives:

- Clipping (`max_grad_norm`, on by default): the tables' gradients are sparse (one row per lookup) and
  torch has no sparse kernel for `linalg_vector_norm`; `attach` registers one
  (`adapters.clipping.enable_sparse_grad_norm`), so Trainer's unchanged `clip_grad_norm_(model.parameters())`
  computes the dense model's global norm, the table rows read in the step (repeats summed) included, and
  scales them with everything else.
- The optimizer: Trainer's default AdamW refuses sparse gradients, so `hf_optimizers` gives the one argument
  Trainer needs, `optimizers=(EngramAdamW, None)`: AdamW on the dense weights, the lazy row update on the
  tables (LR x `table_lr_mult`, no decay), one `state_dict` (tables' moments included: resume is exact);
  Trainer builds its LR scheduler on it from `args` as usual.
- Saving: while attached, `model.save_pretrained(dir)` writes the adapter (`saving.save_pretrained`), so
  `save_model` and every checkpoint hold the adapter, not a copy of the base, and Trainer's resume loads it
  back (`model.safetensors` under the model's own names). LoRA + Engram (`engram.adapters.add_lora`): the PEFT
  model's `save_pretrained` writes PEFT's files and the adapter's beside them, and its `load_adapter` (Trainer's
  resume path for PEFT models) loads both.
- DDP (accelerate / torchrun): the tables are replicated, one full copy per rank; DDP all-reduces (averages)
  their sparse gradients with the dense ones, so every rank clips by the same norm and applies the same
  update: N processes follow one process at the same global batch.

Here, in `training` beside the optimizers it builds (`optim.py`), not in `adapters`: it trains any model with
Engram tables as parameters (an attached adapter, an `EngramForCausalLM`), and the adapters package stays below
training (`engram.hf_optimizers` is this function).
"""

from __future__ import annotations

import torch.nn as nn

from ..adapters.introspect import AdapterError


def hf_optimizers(model: nn.Module, args=None, table_lr_mult: float = 5.0) -> tuple:
    """`optimizers=` for `transformers.Trainer` / TRL trainers training a model with Engram tables:
    `(EngramAdamW, None)` (None: Trainer makes its scheduler from `args`, e.g. linear decay with warmup).

    `args`: the `TrainingArguments` (or `SFTConfig`) the trainer gets: its `learning_rate`, `weight_decay`,
    `adam_beta1`, `adam_beta2`, `adam_epsilon` (None: Trainer's defaults). Dense trainable weights: AdamW,
    decay on matrices only (`optim.dense_groups`, as `engram adapt`); tables: the lazy row update at
    `learning_rate * table_lr_mult`, no decay. Works on any model whose tables are parameters (an attached
    adapter, an `EngramForCausalLM`), also wrapped by PEFT.
    """
    from ..adapters.clipping import enable_sparse_grad_norm
    from ..tables.base import installed_tables
    from .optim import EngramAdamW, dense_groups, split_params

    if args is None:
        from transformers import TrainingArguments

        args = TrainingArguments(output_dir="unused", report_to=[])
    if any(t.trainable for t in installed_tables(model).values()):
        raise AdapterError("hf_optimizers trains tables that are parameters; tables offloaded with trainable=True "
                           "keep their own rows (train those with `engram adapt` or build_optimizers)")
    dense, tables = split_params(model)
    if not dense and not tables:
        raise AdapterError("the model has no trainable parameters (engram.attach an adapter first)")
    lr = args.learning_rate
    groups = [g for g in dense_groups(dense, args.weight_decay) if g["params"]]
    if tables:
        groups.append({"params": [p for _, p in tables], "rows": True, "lr": lr * table_lr_mult})
    enable_sparse_grad_norm()
    opt = EngramAdamW(groups, lr=lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                      weight_decay=args.weight_decay)
    return opt, None
