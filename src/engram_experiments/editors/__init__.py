"""The field's fact editors, implemented here from their papers as baselines for Engram's overlay edits (issue 56):
no maintained package implements them (the `easyedit` name on the package index is an empty placeholder).

Each editor takes a `transformers` causal LM, its tokenizer and a list of `engram.editing.Fact`s, changes the model
in place and returns an `Edit` whose `undo()` restores it exactly (`base.py`). Modules:

    base.py        the `Edit` handle and helpers every editor shares (where a fact's subject ends, target NLL)
    covariance.py  second moments of an MLP's keys over text (ROME and MEMIT's statistics)
    rome.py        ROME (Meng et al. 2022): one rank-one update of one MLP's output weights per fact
    memit.py       MEMIT (Meng et al. 2023): many facts spread over several layers' MLPs by least squares
    grace.py       GRACE (Hartvigsen et al. 2023): a codebook of hidden-state keys with a deferral radius
    finetune.py    FT-L (one layer, norm-bounded), LoRA, and fine-tuning with the neighbours held as data
"""
