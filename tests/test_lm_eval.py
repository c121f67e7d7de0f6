"""lm-evaluation-harness on the repository's tiny tasks (tests/data/lm_eval: multiple choice, rolling
log-likelihood, greedy generation over a local JSONL): engram's model class (`--model engram`) and lm-eval's own
`local-completions` against `engram serve` give the same numbers.

Tolerance: accuracies and exact match equal; every per-document log-likelihood within 1e-4 nats and the
perplexities within 1e-6 relative (one forward in each process, over the same token ids: float rounding only);
the generated texts equal."""

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from test_serve import start  # noqa: E402

TASKS_DIR = Path(__file__).parent / "data" / "lm_eval"
TASKS = ["engram_tiny_mc", "engram_tiny_rolling", "engram_tiny_gen"]


def evaluate(model: str, model_args: dict) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import engram.integrations.lm_eval  # noqa: F401  (registers "engram")

    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)  # (the built-in tasks: not indexed)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, task_manager=tm,
                                   log_samples=True)


def answers(result, task) -> list:
    """Every model answer of a task (log-likelihoods, is-greedy flags, texts), flat, in document order."""
    def flat(x):
        return [v for y in x for v in flat(y)] if isinstance(x, (list, tuple)) else [x]

    return flat([s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])])


def test_the_direct_model_class_and_local_completions_through_engram_serve_agree(tiny_run):
    pytest.importorskip("tenacity")  # (lm-eval's API models need it: lm-eval[api])
    direct = evaluate("engram", {"path": str(tiny_run)})
    p, port = start(["--checkpoint", tiny_run, "--served-model-name", "tiny"])
    try:
        served = evaluate("local-completions", {"base_url": f"http://127.0.0.1:{port}/v1/completions",
                                                "model": "tiny", "max_length": 256})  # (the tiny model's context)
    finally:
        p.terminate()
        p.wait(timeout=60)
    a, b = direct["results"], served["results"]
    for task, metric in (("engram_tiny_mc", "acc,none"), ("engram_tiny_mc", "acc_norm,none"),
                         ("engram_tiny_gen", "exact_match,none")):
        assert a[task][metric] == b[task][metric], (task, metric)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(a["engram_tiny_rolling"][metric], b["engram_tiny_rolling"][metric], rel_tol=1e-6)
    for task in TASKS:
        x, y = answers(direct, task), answers(served, task)
        assert len(x) == len(y) > 0
        for u, v in zip(x, y):
            assert (abs(u - v) < 1e-4) if isinstance(u, float) else u == v, (task, u, v)
    assert len(direct["samples"]["engram_tiny_mc"]) == 8


@pytest.mark.slow
def test_the_cli_finds_the_engram_model_by_name(tiny_run, tmp_path):
    """`python -m engram.integrations.lm_eval` is lm-eval's CLI with `--model engram` registered."""
    import subprocess

    r = subprocess.run([sys.executable, "-m", "engram.integrations.lm_eval", "--model", "engram", "--model_args",
                        f"path={tiny_run}", "--tasks", "engram_tiny_mc", "--include_path", str(TASKS_DIR),
                        "--output_path", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "engram_tiny_mc" in r.stdout and "acc" in r.stdout
