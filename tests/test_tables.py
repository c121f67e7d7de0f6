import math

import pytest
import torch

pytest.importorskip("transformers")

from engram.model import EngramForCausalLM  # noqa: E402
from engram.tables import (  # noqa: E402
    InRamTable,
    MmapTable,
    Prefetcher,
    offload_tables,
    restore_tables,
    write_table_file,
)
from engram.tables.trainable import TableError  # noqa: E402
from engram.training import presets  # noqa: E402


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
    with pytest.raises(TableError, match="header is corrupt"):
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


@pytest.mark.parametrize("inline_below", [16, 0])  # decode steps gathered inline (default) or on the worker
def test_attached_prefetcher_in_generate_matches_plain_generate(inline_below, monkeypatch):
    monkeypatch.setattr(Prefetcher, "inline_below", inline_below)
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


# ---------------------------------------------------------------------------- training with offloaded tables
def _train_steps(model, steps=4, seed=1, fused=True):
    from engram.training.optim import build_optimizers

    opts = build_optimizers(model, lr=3e-3, fused=fused)
    g = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        loss = model(ids, labels=ids).loss
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts.values():
            o.step()
        losses.append(loss.item())
    return losses, opts


@pytest.mark.parametrize("fused", [True, False])  # in place with the numba kernel / torch read-update-write
@pytest.mark.parametrize("backend,cache_rows", [("ram", 0), ("mmap", 0), ("mmap", 64)])
def test_every_backend_trains_like_the_in_ram_parameter(tmp_path, backend, cache_rows, fused):
    """Same losses, same final rows and moments as nn.Embedding + LazyRowAdam (CPU, fp32)."""
    if fused:
        pytest.importorskip("numba")
    from engram.training.optim import LazyRowAdam, TableAdam

    torch.manual_seed(0)
    ref = EngramForCausalLM(presets.tiny())
    m = EngramForCausalLM(presets.tiny())
    m.load_state_dict(ref.state_dict())
    tables = offload_tables(m, backend, tmp_path, cache_bytes=cache_rows * 16 * 4, trainable=True)
    for tb in tables.values():
        if backend == "mmap":
            tb.commit(0)
    ref_losses, ref_opts = _train_steps(ref, fused=fused)
    losses, opts = _train_steps(m, fused=fused)
    assert isinstance(ref_opts["tables"], LazyRowAdam) and isinstance(opts["tables"], TableAdam)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    for mod in ref.modules():
        if hasattr(mod, "multi_head_embedding"):
            W = mod.multi_head_embedding.embedding.weight
            tb = tables[mod.layer_id]
            assert torch.allclose(tb.weight, W.detach(), atol=1e-6)
            st = ref_opts["tables"].state[W]
            assert torch.allclose(tb.exp_avg, st["exp_avg"], atol=1e-7)
            assert torch.allclose(tb.exp_avg_sq, st["exp_avg_sq"], atol=1e-9)
            if cache_rows:
                live = tb.tags >= 0
                assert live.any() and torch.equal(tb.cache[live], tb.weight[tb.tags[live]])  # cache kept coherent
    restore_tables(m)  # back to plain parameters: the same model as the reference
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ref.state_dict().values(), m.state_dict().values()))


def test_mmap_journal_rolls_back_a_killed_write(tmp_path):
    """A write interrupted half-way (and later writes) are undone back to the committed checkpoint."""
    torch.manual_seed(0)
    W = torch.randn(300, 8)
    f = write_table_file(tmp_path / "t.safetensors", W, with_moments=True)
    tb = MmapTable(f, cache_bytes=0, writable=True)
    with pytest.raises(TableError, match="commit"):
        tb.write_rows(torch.tensor([1]), torch.ones(1, 8), torch.ones(1, 8), torch.ones(1, 8))
    tb.commit(0)
    rows = torch.arange(0, 300, 3)
    tb.write_rows(rows, W[rows] + 1, torch.full((100, 8), 0.5), torch.full((100, 8), 0.25))
    tb.commit(10)  # checkpoint at step 10
    at10 = (tb.weight.clone(), tb.exp_avg.clone(), tb.exp_avg_sq.clone())
    tb.write_rows(rows[:50], torch.zeros(50, 8), torch.zeros(50, 8), torch.zeros(50, 8))
    tb.write_rows(rows, torch.full((100, 8), 7.0), torch.ones(100, 8), torch.ones(100, 8))
    # killed in the middle of the next write: its journal entry is complete, half its rows are written
    tb.journal.append(torch.arange(1, 300, 3), *tb._snapshot(torch.arange(1, 300, 3)))
    tb.weight[1:150:3] = -5.0
    tb.flush()
    # ... and a torn entry at the journal's end (the kill landed while appending; its rows were never written)
    jsize = tb.journal_path.stat().st_size
    tb.journal.append(torch.arange(2, 300, 3), *tb._snapshot(torch.arange(2, 300, 3)))
    tb.close()
    with open(tb.journal_path, "r+b") as fh:
        fh.truncate(jsize + 100)
    del tb

    tb = MmapTable(f, cache_bytes=0, writable=True)
    with pytest.raises(TableError, match="cannot be rolled back"):
        tb.recover(0)  # only the newest checkpoint is restorable
    restored = tb.recover(10)
    assert restored == 200  # rows 0::3 (two steps) and 1::3 (the killed write); the torn entry ignored
    for a, b in zip((tb.weight, tb.exp_avg, tb.exp_avg_sq), at10):
        assert torch.equal(a, b)
    tb.close()
    tb.journal_path.unlink()  # without its journal the file cannot be matched to a checkpoint
    with pytest.raises(TableError, match="missing or corrupt"):
        MmapTable(f, writable=True).recover(10)
    read_only = MmapTable(f)
    with pytest.raises(TableError, match="read-only"):
        read_only.read_rows(torch.tensor([0]))
    plain = write_table_file(tmp_path / "plain.safetensors", W)
    with pytest.raises(TableError, match="moments"):
        MmapTable(plain, writable=True)


def test_journal_ahead_takes_the_entries_off_the_step_and_still_rolls_back(tmp_path):
    """The data pipeline journals the next batch's rows while a step writes the current batch's; the step then
    writes no entry of its own, and a rollback restores the checkpoint exactly, rows journaled but never written
    included."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    W = torch.randn(2000, 8)
    f = write_table_file(tmp_path / "t.safetensors", W, with_moments=True)
    tb = MmapTable(f, cache_bytes=0, writable=True)
    tb.journal_ahead(torch.tensor([1, 2]))  # no journal before the first commit: nothing to do
    tb.commit(0)
    at0 = (tb.weight.clone(), tb.exp_avg.clone(), tb.exp_avg_sq.clone())
    g = torch.Generator().manual_seed(1)
    batches = [torch.unique(torch.randint(0, 2000, (300,), generator=g)) for _ in range(12)]
    tb.journal_ahead(batches[0])
    size = tb.journal_path.stat().st_size
    tb.write_rows(batches[0], torch.zeros(len(batches[0]), 8), torch.ones(len(batches[0]), 8),
                  torch.ones(len(batches[0]), 8))
    assert tb.journal_path.stat().st_size == size  # the step found its rows journaled: no entry, no fsync
    assert tb.journal.synced == tb.journal.written  # ... and durable
    stale = tb.journal.file
    tb.commit(0)  # a checkpoint replaces the journal while a pipeline thread's fsync of the old one is pending:
    tb.journal.sync(stale, 1 << 40)  # that fsync has nothing left to do (not an error on the closed file)
    at0 = (tb.weight.clone(), tb.exp_avg.clone(), tb.exp_avg_sq.clone())
    with ThreadPoolExecutor(1) as pipeline:
        for i in range(1, len(batches) - 1):  # step i writes batch i while the pipeline journals batch i + 1
            ahead = pipeline.submit(tb.journal_ahead, batches[i + 1])
            r = batches[i]
            tb.write_rows(r, torch.full((len(r), 8), float(i)), torch.full((len(r), 8), 0.5), torch.ones(len(r), 8))
            ahead.result()
    tb.close()
    tb = MmapTable(f, cache_bytes=0, writable=True)
    tb.recover(0)
    for a, b in zip((tb.weight, tb.exp_avg, tb.exp_avg_sq), at0):
        assert torch.equal(a, b)
    tb.close()


def test_tables_created_as_files_never_live_in_ram(tmp_path):
    """defer_table_allocation + offload_tables(init_seed=): the model never holds its table; the file is N(0,1)."""
    from engram.memory import MultiHeadEmbedding, defer_table_allocation
    from engram.tables import create_table_file

    with defer_table_allocation():
        m = EngramForCausalLM(presets.tiny())
    mhe = next(x for x in m.modules() if isinstance(x, MultiHeadEmbedding))
    assert mhe.embedding.weight.shape[0] == 0 and mhe.num_rows > 0
    with pytest.raises(TableError, match="init_seed"):
        offload_tables(m, "mmap", tmp_path / "a", trainable=True)
    with pytest.raises(TableError, match="defer_table_allocation"):
        offload_tables(m, "ram", trainable=True)
    tables = offload_tables(m, "mmap", tmp_path / "b", trainable=True, init_seed=7)
    tb = next(iter(tables.values()))
    assert (tb.num_rows == mhe.num_rows and abs(float(tb.weight.mean())) < 0.05
            and abs(float(tb.weight.std()) - 1) < 0.05)
    again = MmapTable(create_table_file(tmp_path / "c.safetensors", tb.num_rows, tb.dim, seed=7 + 1))
    assert torch.equal(again.weight, tb.weight)  # seed + layer id: the same rows again
    tb.commit(0)
    losses, _ = _train_steps(m, steps=3)
    assert all(math.isfinite(x) for x in losses)
    changed = (tb.weight != again.weight).any(dim=1)
    assert 0 < int(changed.sum()) < tb.num_rows  # training wrote the looked-up rows into the file, only those


def test_one_safetensors_header_reader_names_what_is_wrong(tmp_path):
    """`header.read_header` is the one parser of safetensors headers (table files, checkpoint shards, the file id block
    sums are bound to): tensor table and metadata of a good file; one `TableError` line for a short, truncated,
    non-safetensors or damaged one, from every caller (`blocks.header_id` included)."""
    import json
    import struct

    from engram.tables.blocks import header_id
    from engram.tables.files import write_safetensors
    from engram.tables.header import read_header

    W = torch.randn(100, 4)
    f = write_safetensors(tmp_path / "t.safetensors", [("weight", torch.float32, (100, 4), iter([W]))],
                          metadata={"format": "engram-table"})
    h = read_header(f)
    n, entries, size = h  # (its older form: header length, entries, file size)
    assert (n, size) == (h.length, f.stat().st_size) and h.data_start == 8 + n == header_id(f)[0]
    assert list(h.tensors) == ["weight"] and h.tensors["weight"]["shape"] == [100, 4]
    assert h.metadata == {"format": "engram-table"} and entries["__metadata__"] == h.metadata
    data = f.read_bytes()

    def damaged(name, raw):
        (tmp_path / name).write_bytes(raw)
        return tmp_path / name

    head = json.loads(data[8:8 + n])
    head["weight"]["data_offsets"] = [0, -4]
    bad_entry = json.dumps(head).encode()
    cases = [(damaged("cut.safetensors", data[:-10]), r"is truncated: its header promises 1,600 data bytes, the "
                                                      r"file has 1,590"),
             (damaged("head.safetensors", data[:20]), "corrupt header length"),
             (damaged("tiny.safetensors", data[:5]), "too short"),
             (damaged("gguf.safetensors", b"GGUF" + bytes(60)), "corrupt header length"),
             (damaged("json.safetensors", struct.pack("<Q", 4) + b"[1] "), "header is corrupt .a JSON dict"),
             (damaged("entry.safetensors", struct.pack("<Q", len(bad_entry)) + bad_entry + data[8 + n:]),
              "header is corrupt .tensor 'weight' has no data offsets")]
    for path, msg in cases:
        for read in (read_header, header_id):
            if read is header_id and path.name == "gguf.safetensors":
                continue  # (a GGUF file's id comes from its own reader)
            with pytest.raises(TableError, match=msg) as e:
                read(path)
            assert "\n" not in str(e.value) and str(path) in str(e.value), (path.name, read.__name__)
    with pytest.raises(TableError, match="no tensor 'codes'"):
        read_header(f, required=("codes",))
