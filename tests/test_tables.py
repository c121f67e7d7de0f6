import pytest
import torch

pytest.importorskip("transformers")

from engram import presets  # noqa: E402
from engram.model import EngramForCausalLM  # noqa: E402
from engram.tables import InRamTable, MmapTable, Prefetcher, offload_tables, write_table_file  # noqa: E402
from engram.tables.backends import TableError  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_backends_gather_identical_rows_and_count_cache(tmp_path, dtype, policy):
    torch.manual_seed(0)
    W = torch.randn(1000, 8).to(dtype)
    f = write_table_file(tmp_path / "t.safetensors", W)
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(f))["weight"], W)  # safetensors-compatible layout
    ram, mm = InRamTable(W), MmapTable(f, cache_bytes=64 * 8 * W.element_size(), policy=policy)
    for _ in range(5):
        rows = torch.randint(0, 50, (200,))  # hot set larger than the cache: hits and misses
        assert torch.equal(ram.gather(rows), W[rows]) and torch.equal(mm.gather(rows), W[rows])
    s = mm.stats()
    assert s["hits"] + s["misses"] == 1000 and s["hits"] > 0 and s["misses"] > 0 and s["cache_rows"] == 64


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cache_stays_consistent_under_slot_conflicts(tmp_path, policy):
    torch.manual_seed(0)
    W = torch.randn(50000, 8)
    mm = MmapTable(write_table_file(tmp_path / "t.safetensors", W), cache_bytes=64 * 8 * 4, policy=policy)
    for _ in range(10):  # many distinct rows per slot in every batch (large enough for parallel kernels)
        rows = torch.randint(0, 50000, (200000,))
        assert torch.equal(mm.gather(rows), W[rows])
    live = mm.tags >= 0
    assert torch.equal(mm.cache[live], W[mm.tags[live]])


def test_short_or_corrupt_table_files_fail_clearly(tmp_path):
    f = write_table_file(tmp_path / "t.safetensors", torch.randn(100, 4))
    data = f.read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:-64])
    with pytest.raises(TableError, match="truncated"):
        MmapTable(tmp_path / "short.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(TableError, match="corrupt header"):
        MmapTable(tmp_path / "junk.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    with pytest.raises(TableError, match="too short"):
        MmapTable(tmp_path / "tiny.safetensors")
    with pytest.raises(TableError, match="not found"):
        MmapTable(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("backend", ["ram", "mmap"])
def test_offloaded_model_and_prefetch_give_identical_logits(tmp_path, backend):
    torch.manual_seed(0)
    m = EngramForCausalLM(presets.tiny()).eval()
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        want = m(ids).logits
        tables = offload_tables(m, backend, tmp_path, cache_bytes=2048)
        assert torch.equal(m(ids).logits, want)
        pf = Prefetcher(m)
        assert torch.equal(m(ids, engram_rows=pf.submit(ids)).logits, want)
        pf.close()
    if backend == "mmap":
        assert m.model.layers[1].engram.multi_head_embedding.embedding.weight.numel() == 0  # RAM copy freed
        assert tables[1].stats()["hits"] + tables[1].stats()["misses"] == 2 * 2 * 16 * 4


def test_attached_prefetcher_in_generate_matches_plain_generate():
    torch.manual_seed(0)
    m = EngramForCausalLM(presets.tiny()).eval()
    ids = torch.randint(0, 1000, (2, 6))
    want = m.generate(ids, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        full = m(want).logits
    pf = Prefetcher.attach(m)
    got = m.generate(ids, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        full_pf = m(want).logits
    pf.close()
    assert torch.equal(got, want) and torch.equal(full_pf, full)
