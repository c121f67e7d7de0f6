"""The tiny lm-eval tasks' documents (tests/data/lm_eval/*.yaml, `custom_dataset: !function
engram_tiny_data.load`): tiny.jsonl beside this file, read into memory, so no task downloads or caches anything."""

import json
from pathlib import Path


def load(**kwargs):
    """{"test": a `datasets.Dataset`} of tiny.jsonl's documents (context, choices, label, text, answer)."""
    import datasets

    lines = (Path(__file__).with_name("tiny.jsonl")).read_text(encoding="utf-8").splitlines()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(x) for x in lines if x.strip()])})
