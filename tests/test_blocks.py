"""Per-block checksums of table files (`engram.tables.blocks`): lazy verification on first read."""

import warnings

import numpy as np
import pytest
import torch

from engram.cli import main
from engram.tables import MmapTable, TableError, write_table_file
from engram.tables.blocks import BlockCrc, BlockVerifier, UnverifiedTableWarning, sidecar, write_block_sums


def flip(path, at, n=16):
    b = bytearray(path.read_bytes())
    b[at:at + n] = bytes(x ^ 0xFF for x in b[at:at + n])
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("piece", [1, 1000, 1 << 16, 3 << 16])
def test_streamed_sums_equal_one_pass(piece):
    data = np.random.default_rng(0).integers(0, 255, 300_001, dtype=np.uint8).tobytes()
    a, b = BlockCrc(1 << 16), BlockCrc(1 << 16)
    a.update(data)
    for i in range(0, len(data), piece):
        b.update(data[i:i + piece])
    assert np.array_equal(a.finish(), b.finish()) and len(a.sums) == 5


def test_a_flipped_byte_fails_on_first_read_of_its_block_only(tmp_path):
    W = torch.randn(20_000, 32)  # 128-byte rows, 512 per 64 KiB block
    f = write_table_file(tmp_path / "t.safetensors", W)
    assert sidecar(f).is_file()
    offset = BlockVerifier.open(f).data_offset
    flip(f, offset + 7000 * 128 + 5)  # inside row 7000 (block 13: rows 6656-7167)
    for cache in (0, 1 << 16):
        t = MmapTable(f, cache_bytes=cache)
        ok = torch.tensor([0, 100, 6655, 7168, 19_999])
        assert torch.equal(t.gather(ok), W[ok])  # other blocks read (and are checked) fine
        with pytest.raises(TableError, match=r"rows 6,656-7,167 \(block 13 of 40\) fail their checksum"):
            t.gather(torch.tensor([3, 7000]))
        with pytest.raises(TableError, match="block 13"):  # and again: a bad block never passes
            t.gather(torch.tensor([6700]))


def test_files_without_or_with_stale_or_corrupt_sums(tmp_path):
    W = torch.randn(2000, 16)
    f = write_table_file(tmp_path / "t.safetensors", W)
    old = sidecar(f).read_bytes()
    sidecar(f).unlink()
    with pytest.warns(UnverifiedTableWarning, match="no block checksums"):
        t = MmapTable(f)
    assert t.blocks is None and torch.equal(t.gather(torch.arange(5)), W[:5])
    write_table_file(f, W * 2)  # a new version of the file: new nonce in its header
    sidecar(f).write_bytes(old)  # ... beside the old version's sums
    with pytest.warns(UnverifiedTableWarning, match="another version"):
        MmapTable(f)
    sidecar(f).write_bytes(b"ENGBLK01garbage")
    with pytest.raises(TableError, match="blocks is corrupt"):
        MmapTable(f)
    write_block_sums(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(MmapTable(f).gather(torch.arange(2000)), W * 2)


def test_training_files_keep_sums_per_commit_and_resume_checks_them(tmp_path):
    W = torch.randn(3000, 16)
    f = write_table_file(tmp_path / "t.safetensors", W, with_moments=True)
    t = MmapTable(f, writable=True, durable=False)
    t.commit(0)
    rows = torch.tensor([5, 2500])
    w, m, v = t.read_rows(rows)
    t.write_rows(rows, w + 1, m + 1, v + 1)  # an optimizer step
    t.commit(1)  # checkpoint 1: the changed blocks are summed again
    t.close()
    assert torch.equal(MmapTable(f).gather(torch.arange(3000))[rows], W[rows] + 1)  # read back verified
    t = MmapTable(f, writable=True, durable=False)
    assert t.recover(1) == 0  # nothing to roll back, every block checked
    t.write_rows(rows, w + 5, m, v)  # a step after checkpoint 1, then a crash
    t.close()
    flip(f, f.stat().st_size - 64)  # ... and damage in the moments, far from the written rows
    t = MmapTable(f, writable=True, durable=False)
    with pytest.raises(TableError, match="cannot resume from this table file"):
        t.recover(1)  # the rollback restores rows 5 and 2500, the flipped bytes fail their block


def test_verify_command_on_a_table_folder(tmp_path, capsys):
    d = tmp_path / "tables"
    f = write_table_file(d / "engram_table_L1.safetensors", torch.randn(5000, 32))
    assert main(["verify", str(d)]) == 0 and "ok" in capsys.readouterr().out
    flip(f, f.stat().st_size - 100)
    assert main(["verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and "1 of 10 blocks fail" in out
    sidecar(f).unlink()
    assert main(["verify", "--write-blocks", str(d)]) == 0  # trusts the file as it is now
    assert "wrote block checksums" in capsys.readouterr().out and sidecar(f).is_file()


def test_rows_changed_after_the_last_commit_are_summed_again_not_flagged(tmp_path):
    """A file trained past its last commit and reopened without recover (a new run keeping the rows) is not
    corrupt: its sums are stale, so the next commit sums every block again."""
    W = torch.randn(3000, 16)
    f = write_table_file(tmp_path / "t.safetensors", W, with_moments=True)
    t = MmapTable(f, writable=True, durable=False)
    t.commit(0)
    rows = torch.tensor([5, 2500])
    w, m, v = t.read_rows(rows)
    t.write_rows(rows, w + 1, m, v)
    t.close()  # no commit: the sums still describe step 0
    t = MmapTable(f, writable=True, durable=False)
    assert torch.equal(t.gather(rows), W[rows] + 1)  # not flagged while training
    t.commit(0)
    t.close()
    assert torch.equal(MmapTable(f).gather(torch.arange(3000))[rows], W[rows] + 1)  # sums current again
