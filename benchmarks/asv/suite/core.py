"""The core costs, one asv benchmark each: hashing, the Engram module forward and backward, table gathers (RAM,
warm mmap, cold disk), a training step and greedy decoding. Timings are asv's (`time_*`, seconds); the cold disk
tier is tracked as its cost against the device's limit measured in the same process (`track_*`): the raw
rows/s of a "cold" read move with this VM's host cache from minute to minute, the ratio much less.

Sizes are cut down from the scripts in benchmarks/ so that a whole suite runs in minutes on 2 cores; the scripts
stay the place for the full-size numbers and the reference/peer ratios.
"""

import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# the disk helpers of benchmarks/bench_disk.py (eviction, the device's limit): one home for them
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_disk  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


class Hashing:
    """n-gram hashing of B=8 x T=4096 tokens for the tutorial's two layers x 16 heads (the mapping's fast path)."""

    timeout = 300

    def setup(self):
        from engram import EngramConfig, get_hash_mapping

        self.mapping = get_hash_mapping(EngramConfig())
        self.ids = torch.randint(0, 128815, (8, 4096), generator=torch.Generator().manual_seed(0))
        self.mapping.hash(self.ids)  # (compiles the kernels outside the timing)

    def time_hash_8x4096(self):
        self.mapping.hash(self.ids)


class Module:
    """One Engram layer (hidden 1024, hc_mult 4, 2 x 8 heads, a 1.6M-row x 64 table), B=2, T=512, from token ids:
    hash, look up, gate, conv. Forward alone, and forward + backward with the sparse table gradient."""

    timeout = 300

    def setup(self):
        from engram import BackBoneConfig, Engram, EngramConfig

        torch.manual_seed(0)
        ecfg = EngramConfig(engram_vocab_size=[400_009, 400_031])
        self.layer = Engram(1, ecfg, BackBoneConfig())
        self.ids = torch.randint(0, 128815, (2, 512))
        self.h = torch.randn(2, 512, 4, 1024)
        self.time_forward()

    def _out(self, h):
        m = self.layer
        return m(h, m.multi_head_embedding(m.hash_mapping.hash(self.ids)[m.layer_id]))[0]

    def time_forward(self):
        with torch.no_grad():
            self._out(self.h)

    def time_forward_backward(self):
        for p in self.layer.parameters():
            p.grad = None
        h = self.h.clone().requires_grad_(True)
        self._out(h).square().mean().backward()


ROWS, DIM = 4_000_000, 32  # a 512 MiB fp32 table file: larger than any cache that could make "cold" warm


class Gathers:
    """Gathering one 4,096-token chunk's 8 heads of rows (32,768 uniform ids) from a 4M x 32 fp32 table: in RAM
    (index_select), memory-mapped and warm, from the disk tier warm, and from the disk tier cold (the file evicted
    from the page cache before each gather; fresh tables each time, as bench_disk.py does)."""

    timeout = 600
    rounds = 3  # (processes: the cold ratio's spread shows across them)

    def setup_cache(self):
        from engram.tables import write_table_file

        d = Path(tempfile.mkdtemp(prefix="engram-asv-"))
        torch.manual_seed(0)
        return str(write_table_file(d / "engram_table_L1.safetensors", torch.randn(ROWS, DIM), page_blocks=True))

    def setup(self, path):
        from engram.tables import MmapTable
        from engram.tables.disk import DiskTable

        self.path = Path(path)
        rng = np.random.default_rng(0)
        self.ids = [torch.from_numpy(rng.integers(0, ROWS, 32768)) for _ in range(3)]
        self.W = torch.randn(ROWS, DIM)
        self.disk, self.mmap = DiskTable(self.path, 32), MmapTable(self.path, cache_bytes=0)
        for c in self.ids:  # warm: every page these ids touch read once through each table
            self.disk.gather(c)
            self.mmap.gather(c)
        self.disk.gather(torch.arange(5))  # (the decode-sized path compiled too)

    def teardown(self, path):
        self.disk.close()
        del self.disk, self.mmap
        gc.collect()

    def time_ram(self, path):
        torch.index_select(self.W, 0, self.ids[0])

    def time_mmap_warm(self, path):
        self.mmap.gather(self.ids[0])

    def time_disk_warm(self, path):
        self.disk.gather(self.ids[0])

    def track_disk_cold_cost_vs_device(self, path):
        """The device's random 4 KiB read limit (fio's when it is installed, else an O_DIRECT pread loop at queue
        depth 32) / distinct cold rows per second of the checked disk tier, both in this process: 1.0 is one row
        per device read at the device's limit, lower is better (asv reads a larger number as worse); bench_disk's
        `cold_vs_device` is its inverse."""
        from engram.tables.disk import DiskTable

        self.teardown(path)  # (pages mapped by this process cannot be evicted)
        rng, rates = np.random.default_rng(1), []
        for _ in range(3):  # (the rows read are checked by the file's block sums, as in use)
            ids = torch.from_numpy(rng.integers(0, ROWS, 32768))
            table = DiskTable(self.path, 32)
            bench_disk.evict(self.path)
            t = time.perf_counter()
            table.gather(ids)
            rates.append(torch.unique(ids).numel() / (time.perf_counter() - t))
            table.close()
            del table
            gc.collect()
        bench_disk.evict(self.path)
        limit = max([bench_disk.device_reads_per_s(self.path, 32, 32768, seed=0),
                     *bench_disk.fio_reads_per_s(self.path, 32, seconds=2).values()])
        self.setup(path)
        return float(limit / np.median(rates))

    track_disk_cold_cost_vs_device.unit = "device reads per row"


class TrainStep:
    """One optimizer step of the cpu-small preset (hidden 256, 4 layers, Engram at 2 blocks), batch x seq of the
    preset, lazy row Adam on the tables, AdamW on the rest."""

    timeout = 600
    number = 1
    repeat = (3, 6, 120.0)

    def setup(self):
        from engram.model import EngramForCausalLM
        from engram.training import presets
        from engram.training.optim import build_optimizers

        tcfg = presets.train_config("cpu-small")
        vocab = int(tcfg.tokenizer.split(":")[1])
        self.ids = torch.randint(2, vocab, (tcfg.batch_size, tcfg.seq_len), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        cfg = presets.cpu_small(vocab_size=vocab, engram={**presets.cpu_small().engram,
                                                          "tokenizer_name_or_path": "deepseek-ai/DeepSeek-V3"})
        self.model = EngramForCausalLM(cfg).train()
        self.opts = build_optimizers(self.model, tcfg.lr)
        self.time_step()

    def time_step(self):
        loss = self.model(self.ids, labels=self.ids).loss
        for o in self.opts.values():
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in self.opts.values():
            o.step()


class Decode:
    """Greedy decoding of 32 tokens after a 64-token prompt, batch 1, cpu-small with Engram (what `engram serve`
    does per request: transformers' generate with the KV cache and engram's per-step hashing)."""

    timeout = 600
    number = 1
    repeat = (3, 6, 120.0)

    def setup(self):
        from engram.model import EngramForCausalLM
        from engram.training import presets

        torch.manual_seed(0)
        cfg = presets.cpu_small(vocab_size=4096, engram={**presets.cpu_small().engram,
                                                         "tokenizer_name_or_path": "deepseek-ai/DeepSeek-V3"})
        self.model = EngramForCausalLM(cfg).eval()
        self.prompt = torch.randint(2, 4096, (1, 64), generator=torch.Generator().manual_seed(0))
        self.time_generate_32()

    def time_generate_32(self):
        with torch.no_grad():
            self.model.generate(self.prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                pad_token_id=0)
