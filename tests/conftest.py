import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("ENGRAM_GOLDEN_DIR", ROOT.parent / "shared" / "golden"))


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not GOLDEN.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"golden vectors missing at {GOLDEN} (CI must provide ../shared/golden)")
        pytest.skip(f"golden vectors not found at {GOLDEN}; set ENGRAM_GOLDEN_DIR")
    return GOLDEN


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Keep the lookup-table cache inside the test session unless the user set one."""
    if "ENGRAM_CACHE_DIR" not in os.environ:
        os.environ["ENGRAM_CACHE_DIR"] = str(tmp_path_factory.mktemp("engram-cache"))
    yield


# ------------------------------------------------------------------------------------------ the two tiers
# Every default-run test is `unit` or `integration` (both run by default; `pytest -m unit` is the fast loop while
# working, under 2 minutes on 2 cores). A test is `integration` when it is marked so (itself or its module) or
# uses a fixture that trains a model (TRAINING_FIXTURES); every other one is `unit`, and the guard below makes the
# tier true: a unit test that starts a Python subprocess, a child process or a training step fails, naming the
# marker to add.
TRAINING_FIXTURES = {"tiny_run"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        trains = TRAINING_FIXTURES & set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("integration") is None and trains:
            item.add_marker(pytest.mark.integration)
        if not any(item.get_closest_marker(m) for m in ("integration", "slow", "vllm")):
            item.add_marker(pytest.mark.unit)


class UnitTierError(RuntimeError):
    pass


@pytest.fixture(autouse=True)
def _unit_tier_guard(request, monkeypatch):
    """In a `unit` test: no Python subprocess, no child process, no training step."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process

    def refuse(what):
        def fail(*args, **kwargs):
            raise UnitTierError(f"a unit test {what}: mark it @pytest.mark.integration (tests/conftest.py)")
        return fail

    real_init = subprocess.Popen.__init__

    def popen(self, args, *rest, **kwargs):  # Python processes only: ctypes.util's ldconfig/gcc probes are fine
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        prog = os.path.basename(str(argv[0])) if argv else ""
        if prog.startswith("python") or str(argv[0]) == sys.executable or prog in ("torchrun", "engram"):
            refuse(f"started a Python subprocess ({prog})")()
        real_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("started a child process"))
    try:
        import engram.training.run as run
    except ImportError:  # (a test environment without the training extras)
        pass
    else:
        monkeypatch.setattr(run, "train_step", refuse("ran a training step"))
    yield


TINY_CORPUS = "".join(f"Line {i}: the cat sat on the mat, the dog ran to the king.\n" for i in range(400))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): its models are
    tiny, and on a shared machine a second thread costs more than it gives (MEMIT's test took 18 s with two, 3 s with
    one)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """One tiny trained run for the whole session: `engram train tiny` for 10 steps on a 400-line corpus,
    checkpoints at steps 5 and 10. Returns the run folder; the corpus is `tiny_run.parent / "c.txt"`.
    Shared and read-only: copy it (`shutil.copytree`) before changing anything in it."""
    from engram.training.train import train

    root = tmp_path_factory.mktemp("tiny")
    corpus = root / "c.txt"
    corpus.write_text(TINY_CORPUS)
    train("tiny", data=[str(corpus)], out=root / "run", max_steps=10, overrides={"ckpt_every": 5, "eval_every": 5},
          progress=False)
    return root / "run"


class Crash(BaseException):
    """The process died here (BaseException, so no `except Exception` cleanup sees it)."""


@pytest.fixture
def crash_at(monkeypatch):
    """crash_at(k): from the k-th filesystem step persist takes on (a rename or a tree removal, the steps every
    engram write goes through), every step raises `Crash`: a killed process runs no cleanup either.
    `crash_at.disarm()` restores the real steps."""
    from engram import persist

    def arm(k):
        calls = [0]

        def step(real):
            def run(*a, **kw):
                calls[0] += 1
                if calls[0] >= k:
                    raise Crash(f"killed at step {k}")
                return real(*a, **kw)
            return run

        monkeypatch.setattr(persist, "_rename", step(os.replace))
        monkeypatch.setattr(persist, "_remove_tree", step(shutil.rmtree))

    def disarm():
        monkeypatch.setattr(persist, "_rename", os.replace)
        monkeypatch.setattr(persist, "_remove_tree", shutil.rmtree)

    arm.disarm = disarm
    return arm


@pytest.fixture
def free_port():
    """A function returning a TCP port on 127.0.0.1 that was free a moment ago."""
    def get() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return get


def run_cli(*args, cwd=None, env=None, timeout=None) -> subprocess.CompletedProcess:
    """`engram ARGS...` in a fresh interpreter (as a user runs it): the one CLI helper of the test suite."""
    return subprocess.run([sys.executable, "-m", "engram.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


# ---------------------------------------------------------------------- damaged checkpoints (released-model loaders)
def damaged_copy(src, dst, edit):
    """A copy of checkpoint folder `src` at `dst`, then `edit(dst)` (e.g. `drop_from_index`, `truncate_file`)."""
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def drop_from_index(folder, key: str) -> None:
    """Remove tensor `key` from `folder`'s safetensors index (the shard still holds it)."""
    import json

    index = folder / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    del idx["weight_map"][key]
    index.write_text(json.dumps(idx))


def truncate_file(path, n: int) -> None:
    """Cut `path` to its first `n` bytes (a shard cut short by an interrupted download)."""
    path.write_bytes(path.read_bytes()[:n])
