"""2-process gloo test: sharded lookup and 3 lazy-Adam training steps equal the single-process run."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.integration  # (trains models or starts servers: tests/conftest.py)

pytest.importorskip("safetensors")

from engram.distributed import ShardedTable, load_sharded, save_sharded  # noqa: E402
from engram.distributed.parallel import shutdown  # noqa: E402
from engram.training.optim import LazyRowAdam  # noqa: E402

ROWS, DIM, STEPS = 101, 8, 3


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, ROWS, (3, 7), generator=g), torch.randn(3, 7, DIM, generator=g)) for _ in range(STEPS)]


def _full_table():
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))


def _worker(rank, world, port, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        W = _full_table()
        table = ShardedTable(ROWS, DIM, init=W)
        rows, target = _data(rank)[0]
        assert torch.equal(table(rows), W[rows])
        opt = LazyRowAdam([table.weight], lr=0.05)
        for rows, target in _data(rank):
            loss = (table(rows) * target).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        save_sharded(table, outdir, opt)
    finally:
        shutdown()


def test_two_rank_sharded_training_equals_single_process(tmp_path, free_port):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    # single process: the same losses summed over both ranks' data, one lazy Adam on the full table
    W = torch.nn.Parameter(_full_table().clone())
    opt = LazyRowAdam([W], lr=0.05)
    data = [_data(0), _data(1)]
    for s in range(STEPS):
        opt.zero_grad()
        loss = sum((torch.nn.functional.embedding(data[r][s][0], W, sparse=True) * data[r][s][1]).sum() for r in (0, 1))
        loss.backward()
        opt.step()
    got = load_sharded(tmp_path, 0, ROWS)  # assembled from the 2 shards: loads at world size 1
    assert torch.allclose(got["weight"], W.detach(), atol=1e-6)
    assert torch.allclose(got["exp_avg"], opt.state[W]["exp_avg"], atol=1e-6)
    part = load_sharded(tmp_path, 30, 80)  # any other split works too
    assert torch.allclose(part["weight"], W.detach()[30:80], atol=1e-6)
    with pytest.raises(ValueError, match="cover"):
        load_sharded(tmp_path, 0, ROWS + 5)


@pytest.mark.slow  # two torchrun runs: 36 s on the 2026-12-05 VM
def test_cli_nproc2_matches_nproc1(tmp_path):
    """`engram train --nproc 2` (torchrun, sharded tables, DDP) ends at the loss of `--nproc 1`."""
    import json

    pytest.importorskip("transformers")
    from conftest import run_cli
    from test_train import make_corpus

    corpus = make_corpus(tmp_path / "corpus")
    losses = {}
    for n in (1, 2):
        r = run_cli("train", "--preset", "tiny", "--data", corpus, "--out", f"run{n}", "--max-steps", "5",
                    "--nproc", n, cwd=tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        rows = [json.loads(l) for l in (tmp_path / f"run{n}" / "metrics.jsonl").read_text().splitlines()]
        losses[n] = [x["train_loss"] for x in rows]
        assert (tmp_path / f"run{n}" / "final" / "model.safetensors").is_file()
    assert len(losses[1]) == len(losses[2]) == 6
    assert max(abs(a - b) for a, b in zip(losses[1], losses[2])) < 1e-4
