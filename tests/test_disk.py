"""The cold disk tier (`engram.tables.disk.DiskTable`): positioned reads, many in flight."""

import os

import pytest
import torch

from engram.tables import TableError, write_table_file
from engram.tables.disk import DiskTable


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathers_equal_the_rows_and_read_each_once(tmp_path, direct, dtype):
    W = torch.randn(5000, 24).to(dtype)  # 48- or 96-byte rows: some straddle 4 KiB pages
    t = DiskTable(write_table_file(tmp_path / "t.safetensors", W), queue_depth=8, direct=direct)
    ids = torch.tensor([[3, 4999, 3], [0, 1706, 4999]])
    assert torch.equal(t.gather(ids), W[ids.reshape(-1)]) and t.stats()["reads"] == 4  # duplicates read once
    every = torch.randperm(5000)
    assert torch.equal(t.gather(every), W[every])
    again = t.gather(every[:100])  # rows on pages read before: from the mapping (buffered), read again (O_DIRECT)
    assert torch.equal(again, W[every[:100]]) and (t.stats()["warm_rows"] == 0) == direct
    with pytest.raises(TableError, match="row ids must lie"):
        t.gather(torch.tensor([5000]))
    t.close()


def test_no_o_direct_falls_back_with_one_warning(tmp_path, monkeypatch):
    f = write_table_file(tmp_path / "t.safetensors", torch.randn(100, 8))
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
    from engram.presets import tiny
    from engram.tables import Prefetcher, offload_tables

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

    from engram.data import Batcher
    from engram.model import EngramForCausalLM
    from engram.presets import tiny
    from engram.tables import offload_tables, readahead_for

    m = EngramForCausalLM(tiny())
    assert readahead_for(m) is None  # tables in the model's parameters: nothing to page in
    (table,) = offload_tables(m, "mmap", tmp_path, trainable=True).values()
    table.commit(0)
    before = table.weight.clone()
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
