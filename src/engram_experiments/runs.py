"""What the experiment drivers share: one training run per (variant, seed), skipped when it has
finished, resumed when it was interrupted, and stopping the whole sweep on Ctrl-C (after the run
checkpointed); and the mean and spread of a value over seeds."""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engram.errors import EngramError
from engram.persist import atomic_write_bytes, read_json, write_json


class ExperimentError(EngramError, ValueError):
    """A file a run or an experiment wrote (`run.json`, `summary.json`, a cached result) is missing or corrupt."""


def run_cli(main, argv: list[str] | None = None) -> None:
    """Run an experiment's ``main(argv)`` as a command: an `ExperimentError` is one line on stderr and exit status
    2, not a traceback."""
    try:
        main(argv)
    except ExperimentError as e:
        print(f"engram: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_shard(text: str, ap) -> tuple[int, int]:
    """`--shard K/N` as (K, N), 0 <= K < N: N processes on N cores share a phase's runs, the K-th taking every N-th
    from the K-th; a bad value is an argparse error naming the form."""
    import re

    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 0 <= int(m[1]) < int(m[2]):
        ap.error(f"--shard {text!r}: give K/N with 0 <= K < N, e.g. 0/2 and 1/2 for two processes")
    return int(m[1]), int(m[2])


def options_argv(o) -> list[str]:
    """`engram experiment NAME`'s options (--out, --record) as the argv of an experiment's own `main`."""
    return ["--out", str(o.out)] + (["--record", str(o.record)] if o.record else [])


def read_result(path: Path, what: str, delete: Path | None = None, expect: type = dict):
    """The JSON file `path` a run or an experiment wrote (`what` names it), or `ExperimentError` in one line
    saying to delete `delete` (default: the file; a run's folder for its files) and run the command again."""
    fix = f"delete {delete or path} and run the command that wrote it again"
    return read_json(path, what, fix, ExperimentError, expect)


def call_in_subprocess(target: str, kwargs: dict, log: Path, what: str, jobs: int = 1) -> None:
    """`target(**kwargs)` ("package.module:function", JSON-able keyword arguments) in a process of its own, its output
    appended to `log`: a run's peak RSS is then its own, and `run_parallel` can train several at once. With `jobs`
    such processes at once, each gets cores/jobs threads unless OMP_NUM_THREADS is set."""
    cmd = [sys.executable, "-m", "engram_experiments.runs", target, json.dumps(kwargs)]
    env = dict(os.environ)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    with open(log, "a") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        raise ExperimentError(f"{what} failed (exit {r.returncode}); see {log}, then run the same command again")


def run_parallel(fn, items: list, jobs: int) -> list:
    """`[fn(x) for x in items]`, `jobs` at a time (threads that each wait on a `call_in_subprocess` run)."""
    if jobs <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(fn, items))


def publish(summary: dict, root: Path, record, name: str, markdown, plot) -> dict:
    """Write an experiment's `summary.json`, `summary.md` (`markdown(summary)`) and `plot.png` (`plot(summary,
    path)`) under `root`, copy the summary to `record/name` when recording (`--record docs/results`), print the
    table and return the summary."""
    write_json(root / "summary.json", summary)
    md = markdown(summary)
    atomic_write_bytes(root / "summary.md", md.encode())
    plot(summary, root / "plot.png")
    if record is not None:
        write_json(Path(record) / name, summary)
    print(md)
    return summary


def seed_stats(xs: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), n, spread (half the range) and the values themselves."""
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs),
            "spread": (max(xs) - min(xs)) / 2 if len(xs) > 1 else 0.0, "values": xs}


def index_environments(runs: list[dict]) -> list[dict]:
    """The distinct environments `runs` recorded; each run's `environment` replaced, in place, by its index there
    (None where a run recorded none): a record keeps each environment once."""
    envs: list[dict] = []
    for r in runs:
        env = r.pop("environment", None)
        if env is not None and env not in envs:
            envs.append(env)
        r["environment"] = envs.index(env) if env is not None else None
    return envs


def detectable(test) -> float | None:
    """`significance.min_detectable` of a `TestResult`, None where there is no spread at all (nothing to scale)."""
    from .significance import min_detectable

    return min_detectable(test) if test.se > 0 else None


def verdict(row: dict, unit: str = "seed") -> str:
    """A tested row's verdict for a table: a finding, or not with what the test could have detected (`row`: its
    `finding`, `se` and `min_detectable`; `unit`: what the pairs are, "seed" or "fact set")."""
    if row["finding"]:
        return "**finding**"
    if row["se"] == 0:
        return f"not a finding (the same on every {unit})"
    return f"not a finding (detectable: ±{row['min_detectable']:.3f})"


def trained_run(run_dir: Path, label: str, seed: int, preset: str, *, data, max_steps: int | None, progress: bool,
                overrides: dict | None = None, **train_kw) -> dict:
    """Train `preset` into `run_dir` with `seed` (unless it finished; resuming a checkpointed one) and
    return `{"seed", "run_dir", **summary.json, "metrics"}`. `label` prefixes the progress line."""
    from engram.training.checkpoint import checkpoints
    from engram.training.run import read_metrics, read_run_file
    from engram.training.train import train

    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        if progress:
            print(f"{label} seed {seed} -> {run_dir}", flush=True)
        done = train(preset, data=data, out=run_dir, max_steps=max_steps, resume=bool(checkpoints(run_dir)),
                     overrides={**(overrides or {}), "seed": seed}, progress=progress, **train_kw)
        if done.get("interrupted"):  # Ctrl-C: the run checkpointed; the same command resumes the sweep
            print("engram: experiment stopped; run the same command again to resume it", flush=True)
            raise KeyboardInterrupt
    else:  # a finished run is reused only if it is the run asked for (a shared or stale OUT could hold another)
        info = read_run_file(run_dir)
        got = (info.get("preset"), info["train"].get("seed"), info.get("model_overrides") or {},
               info.get("use_engram", True), info.get("baseline"))
        want = (preset, seed, train_kw.get("model_overrides") or {}, train_kw.get("use_engram", True),
                train_kw.get("baseline"))
        if got != want:
            raise RuntimeError(f"{run_dir} holds a finished run of preset {got[0]!r}, seed {got[1]}, overrides "
                               f"{got[2:]} but this experiment needs preset {want[0]!r}, seed {want[1]}, overrides "
                               f"{want[2:]}; use another --out or delete that folder")
    summ = read_run_file(run_dir, "summary.json")
    return {"seed": seed, "run_dir": str(run_dir), **summ, "metrics": read_metrics(run_dir / "metrics.jsonl")}


if __name__ == "__main__":  # one call_in_subprocess run: `python -m engram_experiments.runs module:function '{json}'`
    _module, _function = sys.argv[1].split(":")
    getattr(importlib.import_module(_module), _function)(**json.loads(sys.argv[2]))
