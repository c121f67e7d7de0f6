"""The cold disk tier: table rows gathered from a file that is not in the page cache, vs the device's limit.

Table `--rows` x 32 fp32 (default 8M rows = 1 GiB) in a table file. Before every cold round the
file is evicted from the page cache (`posix_fadvise(DONTNEED)`; residency checked with
`fincore` when present). Measured, in the same run and on the same file:
  * device limit: random 4 KiB O_DIRECT reads at queue depth `--qd` (the benchmark's own pread
    loop, `--qd` threads), reads/s;
  * `DiskTable` (buffered, and O_DIRECT) gathering the distinct rows of one 4,096-token prefill
    chunk (4,096 x `--heads` uniform row ids), rows/s; `cold_vs_device` = rows/s / reads/s. The
    file is written as the disk tier writes it (page-aligned 4 KiB block sums) and every block is
    checked on its first read, as in use (fresh tables: every read is a first read, the worst
    case); `cold_unchecked_vs_device` is the same gather with the checks off;
  * `MmapTable` on the same cold file (page faults, one at a time; its block checks off);
  * cold gathers of 8 rows (a decoding step's), 200 of them: read on the calling thread
    (`DiskTable.inline_below`, the default) vs handed to the pool;
  * warm: the same gathers once every page has been read (`DiskTable` then gathers from its
    mapping), vs `index_select` from RAM.
Each cold round uses fresh tables: a page mapped into a process cannot be evicted.
`--against REV`: the same cold gathers also with the `DiskTable` of commit REV (its `src/engram` taken by `git
archive` and imported as a second package), alternating which of the two reads first each round, on the same file
and ids: the interleaved A/B that a regression of the cold path shows in (`asv continuous` runs each commit in its
own processes, where this VM's host cache moves "cold" by tens of percent between minutes).
Prints a table, then one JSON line (`cold_vs_device`, `cold_direct_vs_device`, `cold_mmap_vs_device`,
`cold_unchecked_vs_device`, `warm_vs_ram`, `warm_mmap_vs_ram`; with --against, `against` and its per-round pairs);
`--record FILE` appends that line, with the environment, to a JSON record (docs/results/bench-disk.json).

    python benchmarks/bench_disk.py [--rows 8000000] [--qd 32] [--heads 8] [--rounds 3] [--against REV]
"""

import argparse
import gc
import importlib
import io
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from _record import append_run  # noqa: E402

from engram.tables import MmapTable, write_table_file  # noqa: E402
from engram.tables.disk import DiskTable  # noqa: E402


def evict(path: Path) -> float | None:
    """Drop `path` from the page cache; returns the resident fraction afterwards (None without fincore)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True).stdout.split()
    return int(out[0]) / path.stat().st_size if out else None


def device_reads_per_s(path: Path, qd: int, n_reads: int, seed: int) -> float:
    """Random 4 KiB O_DIRECT reads of `path` with `qd` threads in flight: the device's limit at this depth."""
    size = path.stat().st_size
    offs = np.random.default_rng(seed).integers(0, size // 4096, n_reads) * 4096

    def work(part):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, 4096)
        try:
            for o in part:
                os.preadv(fd, [buf], int(o))
        finally:
            buf.close()
            os.close(fd)

    with ThreadPoolExecutor(qd) as pool:
        t = time.perf_counter()
        list(pool.map(work, np.array_split(offs, qd)))
        return n_reads / (time.perf_counter() - t)


def disk_table_at(rev: str, into: Path):
    """`DiskTable` as commit `rev` of this repository wrote it: `src/engram` of `rev` extracted under `into` as the
    package `engram_at_rev` and imported (its table modules import only relatively)."""
    repo = Path(__file__).resolve().parents[1]
    tar = subprocess.run(["git", "archive", rev, "src/engram"], cwd=repo, capture_output=True)
    if tar.returncode:
        raise SystemExit(f"bench_disk: --against {rev}: {tar.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(into, filter="data")
    (into / "src" / "engram").rename(into / "engram_at_rev")
    sys.path.insert(0, str(into))
    return importlib.import_module("engram_at_rev.tables.disk").DiskTable


def compile_readers(d: Path, rows: torch.Tensor, directs=(False,)) -> None:
    """Run `DiskTable`'s compiled readers (numba) once on a small file in `d`, outside the timed gathers."""
    small = write_table_file(Path(d) / "warmup.safetensors", rows[:10000], page_blocks=True)
    for direct in directs:
        table = DiskTable(small, direct=direct)
        table.gather(torch.arange(0, 10000, 7))  # a pool-sized gather
        table.gather(torch.arange(5))  # a decode-step-sized one
        table.close()


def cold_gather(table, path: Path, ids: torch.Tensor, want: torch.Tensor) -> tuple[float, float | None]:
    """Evict `path`, time `table.gather(ids)` (rows of the file), check the rows against `want`, close the table.
    Returns (distinct rows per second, resident fraction after the eviction). `table` must be fresh: pages an
    earlier table mapped could not be evicted."""
    resident = evict(path)
    t = time.perf_counter()
    got = table.gather(ids)
    rate = torch.unique(ids).numel() / (time.perf_counter() - t)
    assert torch.equal(got.float(), want), f"{path.name}: rows differ"
    table.close()
    del table, got
    gc.collect()
    return rate, resident


def fio_read(path: Path, *args: str) -> dict | None:
    """fio's read statistics (`iops`, `bw_bytes`, ...) of one job group reading `path` with `args`; None when
    fio is missing or the job fails (e.g. an I/O engine this kernel lacks)."""
    if shutil.which("fio") is None:
        return None
    r = subprocess.run(["fio", "--name=limit", f"--filename={path}", *args, "--readonly", "--group_reporting",
                        "--output-format=json"], capture_output=True, text=True)
    try:
        return json.loads(r.stdout)["jobs"][0]["read"]
    except (ValueError, KeyError, IndexError):
        return None


def fio_reads_per_s(path: Path, qd: int, seconds: int = 4) -> dict:
    """The device's random 4 KiB O_DIRECT read limit at queue depth `qd` by fio, when it is installed:
    {engine: IOPS} for `qd` synchronous jobs (psync) and one job with `qd` in flight (io_uring)."""
    out = {}
    for engine, depth in (("psync", ["--numjobs", str(qd), "--iodepth", "1"]),
                          ("io_uring", ["--numjobs", "1", "--iodepth", str(qd)])):
        r = fio_read(path, "--rw=randread", "--bs=4k", "--direct=1", f"--ioengine={engine}", *depth,
                     f"--runtime={seconds}", "--time_based")
        if r is not None:  # (None: no fio, or an engine this kernel lacks)
            out[engine] = float(r["iops"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to write the table file (default: a temp dir)")
    ap.add_argument("--against", metavar="REV", help="also gather cold with commit REV's DiskTable, interleaved")
    ap.add_argument("--record", metavar="FILE", help="append the JSON line, with the environment, to this record")
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    chunks = [torch.from_numpy(rng.integers(0, args.rows, 4096 * args.heads)) for _ in range(args.rounds)]
    res = {k: [] for k in ("device", "disk", "disk direct", "disk unchecked", "mmap", "against")}
    resident = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        W = torch.randn(args.rows, 32)
        f = write_table_file(Path(d) / "engram_table_L1.safetensors", W, page_blocks=True)
        makers = {"disk": lambda: DiskTable(f, args.qd), "disk direct": lambda: DiskTable(f, args.qd, direct=True),
                  "disk unchecked": lambda: DiskTable(f, args.qd), "mmap": lambda: MmapTable(f, cache_bytes=0)}
        compile_readers(d, W, directs=(False, True))
        if args.against:
            Base = disk_table_at(args.against, Path(d) / "against")
            makers["against"] = lambda: Base(f, args.qd)
            table = Base(write_table_file(Path(d) / "warmup2.safetensors", W[:10000], page_blocks=True))
            table.gather(torch.arange(0, 10000, 7))  # (its own compiled readers, outside the timing)
            table.gather(torch.arange(5))
            table.close()
        for r, ids in enumerate(chunks):
            resident.append(evict(f))
            res["device"].append(device_reads_per_s(f, args.qd, torch.unique(ids).numel(), seed=r))
            order = list(makers)
            if args.against and r % 2:  # the other commit reads first every other round
                order = ["against", *[k for k in order if k != "against"]]
            for name in order:
                table = makers[name]()  # fresh: no page of the file mapped, so eviction can drop them all
                if name in ("mmap", "disk unchecked"):
                    table.blocks = None  # no block checks: page faults / positioned reads only
                res[name].append(cold_gather(table, f, ids, W[ids])[0])
                del table  # (before the next eviction: a table still referenced keeps its pages)
        # warm: the file in the page cache (read once through each table), vs index_select from RAM
        disk, mm = DiskTable(f, args.qd), MmapTable(f, cache_bytes=0)
        for c in chunks:
            disk.gather(c)
            mm.gather(c)
        fns = {"ram": lambda c: torch.index_select(W, 0, c), "disk": disk.gather, "mmap": mm.gather}
        times = {k: [] for k in fns}
        for r in range(30):  # interleaved: the machine's noise hits all three alike
            for k, fn in fns.items():
                t = time.perf_counter()
                fn(chunks[r % len(chunks)])
                times[k].append(time.perf_counter() - t)
        warm = {k: statistics.median(v) for k, v in times.items()}
        disk.close()
        del fns, fn, disk, mm  # (pages they mapped could not be evicted for the next test)
        gc.collect()
        # decode-sized gathers (8 cold rows): on the calling thread (the default, one compiled call with numba) vs
        # handed to the pool (inline_below=0)
        small = {}
        for name, inline in (("calling thread", DiskTable.inline_below), ("pool", 0)):
            table = DiskTable(f, args.qd)
            table.inline_below = inline
            resident.append(evict(f))
            ts = []
            for _ in range(200):
                ids = torch.from_numpy(rng.integers(0, args.rows, 8))
                t = time.perf_counter()
                table.gather(ids)
                ts.append(time.perf_counter() - t)
            small[name] = statistics.median(ts)
            table.close()
            del table
            gc.collect()
        evict(f)
        fio = fio_reads_per_s(f, args.qd)
    med = {k: statistics.median(v) for k, v in res.items() if v}
    limit = max(fio.values()) if fio else med["device"]
    n_ids = 4096 * args.heads
    print(f"table {args.rows:,} x 32 fp32 ({args.rows * 128 / 2**30:.2f} GiB), cold rounds {args.rounds}, queue depth "
          f"{args.qd}, one 4,096-token chunk x {args.heads} heads = {n_ids:,} ids per gather; resident after eviction: "
          f"{', '.join('n/a' if x is None else f'{x:.1%}' for x in resident)}")
    print(f"{'cold':<28} {'rows/s':>10} {'vs device':>10}")
    for engine, iops in fio.items():
        print(f"{f'device, fio {engine}':<28} {iops:>10,.0f} {iops / limit:>10.2f}")
    print(f"{'device, own pread loop':<28} {med['device']:>10,.0f} {med['device'] / limit:>10.2f}")
    labels = {"disk": "DiskTable (checked)", "disk direct": "DiskTable O_DIRECT (checked)",
              "disk unchecked": "DiskTable, checks off", "mmap": "MmapTable (page faults)"}
    if args.against:
        labels["against"] = f"DiskTable at {args.against}"
    for k, label in labels.items():
        print(f"{label:<28} {med[k]:>10,.0f} {med[k] / limit:>10.2f}")
    print("cold gathers of 8 rows (a decode step): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in small.items()))
    print(f"warm gathers of {n_ids:,} ids: RAM {warm['ram'] * 1e3:.2f} ms, DiskTable {warm['disk'] * 1e3:.2f} ms, "
          f"MmapTable {warm['mmap'] * 1e3:.2f} ms")
    out = {"bench": "disk", "rows": args.rows, "qd": args.qd, "device_reads_s": round(limit),
           "device_limit_by": "fio" if fio else "own pread loop", "own_loop_reads_s": round(med["device"]),
           "cold_vs_device": round(med["disk"] / limit, 3),
           "cold_direct_vs_device": round(med["disk direct"] / limit, 3),
           "cold_mmap_vs_device": round(med["mmap"] / limit, 3),
           "cold_unchecked_vs_device": round(med["disk unchecked"] / limit, 3),
           "small_cold_gather_ms": {k: round(v * 1e3, 3) for k, v in small.items()},
           "warm_vs_ram": round(warm["ram"] / warm["disk"], 3),
           "warm_mmap_vs_ram": round(warm["ram"] / warm["mmap"], 3)}
    if args.against:
        out.update(against=args.against, cold_vs_device_against=round(med["against"] / limit, 3),
                   rounds_vs_device={"this": [round(x / limit, 3) for x in res["disk"]],
                                     "against": [round(x / limit, 3) for x in res["against"]]})
    print(json.dumps(out))
    if args.record:
        append_run(args.record, "python benchmarks/bench_disk.py [--against REV]", out)


if __name__ == "__main__":
    main()
