"""Saves killed at every filesystem step: a sharded table's shard set, a table file and an undo journal come
back old or new, complete, never mixed or half-written.

A kill is simulated by making the k-th call of `persist._rename` / `persist._remove_tree` (the steps every
engram write goes through) and every call after it raise: a dead process runs no cleanup either.
"""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("safetensors")

from conftest import Crash

from engram import persist
from engram.distributed import ShardedTable, load_sharded, save_sharded
from engram.distributed.sharded import shard_range

ROWS, DIM = 37, 4


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group (ShardedTable needs torch.distributed)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def write_old_shard_set(d, W):
    """A two-rank shard set as engram before 0.3 wrote it (in place, no manifest): weights only."""
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    for rank in range(2):
        lo, hi = shard_range(ROWS, rank, 2)
        save_file({"weight": W[lo:hi].contiguous()}, str(d / f"shard_{rank}.safetensors"))
        (d / f"shard_{rank}.json").write_text(json.dumps({"lo": lo, "hi": hi, "num_rows": ROWS, "dim": DIM,
                                                           "step": 0}))


def test_sharded_save_killed_at_every_step_leaves_the_old_or_the_new_shard_set(tmp_path, one_rank, crash_at):
    g = torch.Generator().manual_seed(0)
    old_w, new_w = torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, DIM, generator=g)
    table = ShardedTable(ROWS, DIM, init=new_w)
    moments = {"exp_avg": torch.randn(ROWS, DIM, generator=g), "exp_avg_sq": torch.rand(ROWS, DIM, generator=g)}
    opt = SimpleNamespace(state={table.weight: {**moments, "step": torch.tensor(3.0)}})
    new = {"weight": new_w, **moments}
    seen, k = set(), 1
    while True:
        d = tmp_path / f"kill{k}" / "tables"
        write_old_shard_set(d, old_w)
        crash_at(k)
        try:
            save_sharded(table, d, opt)
            finished = True
        except Crash:
            finished = False
        crash_at.disarm()
        got = load_sharded(d, 0, ROWS)  # every row covered exactly once, or it raises
        if set(got) == {"weight"}:
            assert torch.equal(got["weight"], old_w), k
            seen.add("old")
        else:
            assert set(got) == set(new) and all(torch.equal(got[n], new[n]) for n in new), k
            seen.add("new")
        save_sharded(table, d, opt)  # the next save after the kill completes and leaves nothing behind
        got = load_sharded(d, 0, ROWS)
        assert all(torch.equal(got[n], new[n]) for n in new)
        assert sorted(p.name for p in d.parent.iterdir()) == ["tables"]
        assert persist.verify_manifest(d)
        if finished:
            break
        k += 1
    assert k > 4 and seen == {"old", "new"}  # it was killed before, between and after the swap's renames


def test_sharded_sets_of_the_previous_version_still_load(tmp_path):
    W = torch.randn(ROWS, DIM)
    write_old_shard_set(tmp_path / "tables", W)
    assert torch.equal(load_sharded(tmp_path / "tables", 5, 30)["weight"], W[5:30])


def test_table_file_write_killed_keeps_the_old_file_and_its_sums(tmp_path, crash_at):
    from engram.tables import MmapTable, write_table_file

    old, new = torch.randn(100, 8), torch.randn(100, 8)
    f = write_table_file(tmp_path / "t.safetensors", old)
    crash_at(1)  # before the table file's rename
    with pytest.raises(Crash):
        write_table_file(f, new)
    crash_at.disarm()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors", "t.safetensors.blocks"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its block sums still describe it: verified, no warning
        assert torch.equal(MmapTable(f).gather(torch.arange(100)), old)


def test_journal_restart_killed_keeps_the_old_journal(tmp_path, crash_at):
    from engram.tables.journal import UndoJournal

    j = UndoJournal(tmp_path / "t.safetensors", 10, 4, torch.float32)
    j.restart(3)
    j.close()
    crash_at(1)
    with pytest.raises(Crash):
        UndoJournal(tmp_path / "t.safetensors", 10, 4, torch.float32).restart(7)
    crash_at.disarm()
    assert UndoJournal(tmp_path / "t.safetensors", 10, 4, torch.float32).step() == 3
