"""The cold disk tier (`engram.tables.disk.DiskTable`): positioned reads, many in flight."""

import os
import warnings

import pytest
import torch

from engram.jit import LazyKernels
from engram.tables import TableError, disk, write_table_file
from engram.tables.blocks import PAGE, write_block_sums
from engram.tables.disk import DiskTable
from engram.tables.header import read_header


@pytest.fixture(params=["compiled", "python"])
def reader(request, monkeypatch):
    """Cold rows read by the GIL-free compiled loop (engram-torch[fast]) or the Python loop that stands in without
    numba."""
    if request.param == "compiled":
        if disk._READER.get() is None:
            pytest.skip("numba not installed")
    else:
        monkeypatch.setattr(disk, "_READER", LazyKernels(lambda: None))
    return request.param


@pytest.mark.parametrize("page_blocks", [True, False])
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathers_equal_the_rows_and_read_each_once(tmp_path, direct, dtype, page_blocks, reader):
    W = torch.randn(5000, 24).to(dtype)  # 48- or 96-byte rows: some straddle 4 KiB pages
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (64 KiB sums: "first reads fetch whole blocks")
        t = DiskTable(write_table_file(tmp_path / "t.safetensors", W, page_blocks=page_blocks), queue_depth=8,
                      direct=direct)
    ids = torch.tensor([[3, 4999, 3], [2000, 1706, 4999]])  # four distinct rows on four pages
    assert torch.equal(t.gather(ids), W[ids.reshape(-1)]) and t.stats()["reads"] == 4  # duplicates read once
    every = torch.randperm(5000)
    assert torch.equal(t.gather(every), W[every])
    again = t.gather(every[:100])  # rows on pages read before: from the mapping (buffered), read again (O_DIRECT)
    assert torch.equal(again, W[every[:100]]) and (t.stats()["warm_rows"] == 0) == direct
    with pytest.raises(TableError, match="row ids must lie"):
        t.gather(torch.tensor([5000]))
    t.close()


def test_disk_tier_files_are_page_aligned_and_still_safetensors(tmp_path):
    from safetensors.torch import load_file

    W = torch.randn(1000, 20)
    f = write_table_file(tmp_path / "t.safetensors", W, page_blocks=True)
    n, _, _ = read_header(f)
    assert (8 + n) % PAGE == 0 and torch.equal(load_file(str(f))["weight"], W)  # padded header: plain safetensors
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # page sums: no "whole 64 KiB blocks" warning
        t = DiskTable(f)
    assert t.blocks.block_bytes == PAGE and torch.equal(t.gather(torch.arange(1000)), W)


def _flip(f, at: int) -> None:
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("page_blocks", [True, False])
def test_a_flipped_byte_is_caught_on_the_cold_read(tmp_path, direct, page_blocks, reader):
    W = torch.randn(20000, 16)  # 64-byte rows
    f = write_table_file(tmp_path / "t.safetensors", W, page_blocks=page_blocks)
    n, meta, _ = read_header(f)
    row = 12345
    _flip(f, 8 + n + row * 64 + 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = DiskTable(f, direct=direct)
    ok = torch.tensor([0, 1, 19999])  # far from the damage: read and checked
    assert torch.equal(t.gather(ok), W[ok])
    with pytest.raises(TableError, match=r"rows [\d,]+-[\d,]+ \(block \d+ of \d+\) fail their checksum") as e:
        t.gather(torch.tensor([row - 3, 7]))  # a neighbour of the damaged row, in the same block
    assert "\n" not in str(e.value) and str(f) in str(e.value)


def test_a_warm_page_never_serves_an_unchecked_block(tmp_path, reader):
    """Sums whose 4 KiB blocks are not page-aligned: every page touches two blocks. Reading a row checks its own
    block; the page is warm (gathered from the mapping) only when the other block is checked too."""
    W = torch.randn(20000, 16)  # 64-byte rows
    f = write_table_file(tmp_path / "t.safetensors", W)
    write_block_sums(f, block_bytes=PAGE)  # unaligned 4 KiB blocks (the header is not padded)
    n, _, _ = read_header(f)
    data = 8 + n
    assert data % PAGE
    t = DiskTable(f)
    page = 10  # a page straddling blocks b and b + 1
    b_lo = (page * PAGE - data) // PAGE
    row_in_lo = (page * PAGE - data) // 64 + 1  # on the page, in block b_lo
    row_in_hi = ((b_lo + 1) * PAGE) // 64 + 1  # on the page, in block b_lo + 1
    assert (data + row_in_hi * 64) // PAGE == page and (row_in_hi * 64) // PAGE == b_lo + 1
    _flip(f, data + row_in_hi * 64 + 3)
    assert torch.equal(t.gather(torch.tensor([row_in_lo])), W[[row_in_lo]])
    with pytest.raises(TableError, match="fail their checksum"):
        t.gather(torch.tensor([row_in_hi]))


def test_no_o_direct_falls_back_with_one_warning(tmp_path, monkeypatch):
    f = write_table_file(tmp_path / "t.safetensors", torch.randn(100, 8), page_blocks=True)
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    with pytest.warns(UserWarning, match="O_DIRECT is not available"):
        t = DiskTable(f, direct=True)
    assert not t.direct and t.gather(torch.tensor([5])).shape == (1, 8)


def test_truncated_file_is_refused(tmp_path):
    f = write_table_file(tmp_path / "t.safetensors", torch.randn(1000, 8))
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(TableError, match="truncated"):
        DiskTable(f)


def test_model_served_from_the_disk_tier(tmp_path):
    pytest.importorskip("transformers")
    from engram.model import EngramForCausalLM
    from engram.tables import Prefetcher, offload_tables
    from engram.training.presets import tiny

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 20))
    m = EngramForCausalLM(tiny()).eval()
    with torch.no_grad():
        want = m(ids).logits
        offload_tables(m, "disk", tmp_path)
        assert torch.equal(m(ids).logits, want)
        Prefetcher.attach(m)  # reads of the next call overlap this one's compute
        assert torch.equal(m(ids).logits, want)
        Prefetcher.detach(m)
    with pytest.raises(TableError, match="read-only"):
        offload_tables(EngramForCausalLM(tiny()), "disk", tmp_path / "x", trainable=True)


def test_training_pipeline_reads_the_next_batch_ahead(tmp_path):
    pytest.importorskip("transformers")
    import numpy as np

    from engram.model import EngramForCausalLM
    from engram.tables import offload_tables, readahead_for
    from engram.training.data import Batcher
    from engram.training.presets import tiny

    m = EngramForCausalLM(tiny())
    assert readahead_for(m) is None  # tables in the model's parameters: nothing to page in
    (table,) = offload_tables(m, "mmap", tmp_path, trainable=True).values()
    table.commit(0)
    before = table.weight.clone()
    empty_journal = table.journal_path.stat().st_size
    touched = []
    table.touch = lambda rows, orig=table.touch: (touched.append(rows), orig(rows))[1]
    b = Batcher(np.arange(2000, dtype=np.uint32) % 1000, 16, 2, hash_mapping=m.model.mapping,
                readahead=readahead_for(m))
    ids, hashes = b.next()  # hashes this batch inline, then the next one (and its read-ahead) on the thread
    b._pending[0].join()
    mhe = m.model.layers[1].engram.multi_head_embedding
    first = torch.unique((hashes[1] + mhe._offsets_on(torch.device("cpu"))).reshape(-1))
    assert len(touched) == 2 and torch.equal(touched[0], first)  # this batch's rows, then the next batch's
    assert torch.equal(table.weight, before)  # reading ahead changes nothing
    assert table.journal_path.stat().st_size > empty_journal  # ... but journals those rows for the coming steps
    from engram.training.config import TrainConfig
    assert TrainConfig.parse_overrides(["table_readahead=false"]) == {"table_readahead": False}


def test_plan_ranges_merges_near_rows_and_keeps_far_ones_apart():
    import numpy as np

    rows = np.array([0, 1, 2, 50, 1000])  # 100-byte rows: 0-2 on page 0, 50 on page 1 (adjacent), 1000 on page 24
    r = disk.plan_ranges(rows, 100, 0, PAGE, 0)
    assert r.tolist() == [[0, 2 * PAGE, 0, 4], [24 * PAGE, 25 * PAGE, 4, 5]]
    r = disk.plan_ranges(np.arange(0, 100_000, 7), 100, 0, PAGE, 0, max_bytes=64 << 10)  # one dense run, cut
    assert len(r) > 1 and (r[1:, 0] >= r[:-1, 1] - PAGE).all() and (r[:, 1] - r[:, 0]).max() <= (64 << 10) + 2 * PAGE
    assert r[0, 2] == 0 and r[-1, 3] == len(np.arange(0, 100_000, 7)) and (r[1:, 2] == r[:-1, 3]).all()


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("page_blocks", [True, False])
def test_dense_gathers_read_ranges_and_still_check_every_block(tmp_path, direct, page_blocks, reader):
    W = torch.randn(20000, 20)  # 80-byte rows: many per page, some straddle pages
    f = write_table_file(tmp_path / "t.safetensors", W, page_blocks=page_blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = DiskTable(f, queue_depth=4, direct=direct)
    ids = torch.randperm(20000)[:6000]
    assert torch.equal(t.gather(ids), W[ids])
    if reader == "compiled":
        assert 0 < t.stats()["ranges"] < 6000 / 4  # coalesced: far fewer reads than rows
    n, _, _ = read_header(f)
    _flip(f, 8 + n + 15000 * 80 + 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t2 = DiskTable(f, queue_depth=4, direct=direct)
    with pytest.raises(TableError, match="fail their checksum"):
        t2.gather(torch.arange(14990, 15030))  # 40 rows around the damage: the range path
    t.close()
    t2.close()
