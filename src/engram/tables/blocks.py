"""Per-block checksums of table files: a 100 GB table opens at once, and each block is checked on first read.

    <table>.safetensors.blocks    b"ENGBLK01" | u32 header length | JSON header | crc32 of each block (u32 LE)

The header names the table file it describes (`file_bytes`, `file_id`: sha256 of the table file's
safetensors header, which carries a fresh nonce per write) and the block geometry (`data_offset`,
`block_bytes`, 64 KiB by default). Block b covers file bytes `[data_offset + b * block_bytes, ...)`.

`write_safetensors(..., block_sums=True)` computes the sums while it streams the file (table files
are written that way), `write_block_sums(path)` adds them to an existing file, and `BlockVerifier`
checks a block the first time any row in it is read (`MmapTable.gather`): a flipped byte is a
one-line `TableError` naming the file, the rows and the repair, on first use, never a silently
wrong row. A file without sums still opens, with one warning. Writable (training) tables are
covered by their undo journal and checkpoints instead: their sums are dropped at the first write.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from ..jit import LazyKernels
from ..persist import (
    UnverifiedWarning,
    atomic_write_bytes,
    decode_json_bytes,
    sha256_bytes,
)
from .base import TableError
from .header import read_header

SUFFIX = ".blocks"
MAGIC = b"ENGBLK01"
BLOCK_BYTES = 1 << 16
PAGE = 4096  # block size of the disk tier's files (`write_safetensors(page_blocks=True)`): one page per cold row
FIX = "re-create the table file (engram train/serve writes it again) or re-download it"


def row_span(rows, row_bytes: int, offset: int, unit: int):
    """(first, last) `unit`-sized piece (page, checksum block) of the file holding each of `rows` (N,) of a
    tensor whose row 0 starts at byte `offset`: a row may straddle two."""
    start = rows * row_bytes + offset  # (N,) first byte of each row
    return start // unit, (start + row_bytes - 1) // unit


def _build_kernels():
    import numba

    @numba.njit(cache=True, nogil=True)
    def first_unchecked(rows, base, shift, ok):  # index of the first row whose block is unchecked, or -1
        for i in range(rows.shape[0]):
            if not ok[(rows[i] + base) >> shift]:
                return i
        return -1

    return first_unchecked


_KERNELS = LazyKernels(_build_kernels)  # optional (engram-torch[fast]); the torch ops do the same without numba


class UnverifiedTableWarning(UnverifiedWarning):
    """A table file without (current) block checksums was opened unverified."""


def sidecar(path) -> Path:
    p = Path(path)
    return p.with_name(p.name + SUFFIX)


HEADER_IDS: dict = {}  # file magic -> header_id(path) of table files in other formats (b"GGUF": `tables.gguf`)


def header_id(path) -> tuple[int, str]:
    """(data offset, sha256 of the header bytes) of a table file: what its block sums are bound to (a safetensors
    header carries a fresh nonce per write). The header is read and checked by `header.read_header`; table files of
    another format (b"GGUF": `tables.gguf`) register their own reader in `HEADER_IDS`."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic in HEADER_IDS:
        return HEADER_IDS[magic](path)
    header = read_header(path, required=())
    with open(path, "rb") as f:
        f.seek(8)
        return header.data_start, sha256_bytes(f.read(header.length))[:32]


def block_crc(data, start: int = 0) -> int:
    """The sum of one block's bytes (crc32, zlib's), continuing from `start` when fed in pieces: the one
    definition every writer and checker uses (the GIL-free disk reader calls the same zlib function)."""
    return zlib.crc32(data, start)


class BlockCrc:
    """crc32 per `block_bytes` of a byte stream fed in pieces of any size (`update`), `finish()` -> uint32 array."""

    def __init__(self, block_bytes: int = BLOCK_BYTES):
        self.block_bytes, self.sums, self.cur, self.fill = block_bytes, [], 0, 0

    def update(self, data) -> None:
        mv, pos = memoryview(data).cast("B"), 0
        while pos < len(mv):
            take = min(self.block_bytes - self.fill, len(mv) - pos)
            self.cur = block_crc(mv[pos:pos + take], self.cur)
            self.fill += take
            pos += take
            if self.fill == self.block_bytes:
                self.sums.append(self.cur)
                self.cur = self.fill = 0

    def finish(self) -> np.ndarray:
        if self.fill:
            self.sums.append(self.cur)
            self.cur = self.fill = 0
        return np.asarray(self.sums, dtype="<u4")


def write_sums(path, sums: np.ndarray, block_bytes: int = BLOCK_BYTES) -> Path:
    """Store the block sums of table file `path` beside it (atomically); call after the table file is in place."""
    offset, fid = header_id(path)
    head = json.dumps({"format": "engram-blocks/1", "file_bytes": Path(path).stat().st_size, "file_id": fid,
                       "data_offset": offset, "block_bytes": block_bytes, "blocks": int(len(sums))}).encode()
    out = sidecar(path)
    atomic_write_bytes(out, MAGIC + struct.pack("<I", len(head)) + head + np.asarray(sums, dtype="<u4").tobytes())
    return out


def write_block_sums(path, block_bytes: int = BLOCK_BYTES) -> Path:
    """Compute and store the block sums of an existing table file (one pass over it)."""
    offset, _ = header_id(path)
    acc = BlockCrc(block_bytes)
    with open(path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(1 << 24):
            acc.update(chunk)
    return write_sums(path, acc.finish(), block_bytes)


def drop_sums(path) -> None:
    """Remove a table file's block sums (it is about to change in place)."""
    try:
        os.remove(sidecar(path))
    except FileNotFoundError:
        pass


class BlockVerifier:
    """Checks the blocks of one table file the first time they are read; `check_rows` is the hot path."""

    def __init__(self, path: Path, sums: np.ndarray, data_offset: int, block_bytes: int):
        self.path, self.sums, self.data_offset, self.block_bytes = path, sums, data_offset, block_bytes
        self.size = size = path.stat().st_size - data_offset
        self.data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_offset, shape=(size,)) if size else None
        self.ok = torch.zeros(len(sums), dtype=torch.bool)
        self.ok_np = self.ok.numpy()  # the same flags, for fast scalar reads and writes
        self.unverified = len(sums)
        self._lock = threading.Lock()  # the disk tier's reader threads mark blocks checked concurrently

    @classmethod
    def open(cls, path) -> "BlockVerifier | None":
        """The verifier of table file `path`, or None (and one warning) when it has no current sums."""
        path = Path(path)
        sc = sidecar(path)
        if not sc.is_file():
            warnings.warn(f"{path} has no block checksums ({sc.name}): its rows are not verified; add them with "
                          f"engram verify --write-blocks {path.parent}", UnverifiedTableWarning, stacklevel=3)
            return None
        raw = sc.read_bytes()
        fix = f"delete it and run engram verify --write-blocks {path.parent} (after checking the table another way)"
        if raw[:8] != MAGIC or len(raw) < 12:
            raise TableError(f"{sc} is corrupt (bad magic); {fix}")
        (hl,) = struct.unpack_from("<I", raw, 8)
        head = decode_json_bytes(raw[12:12 + hl], str(sc), fix, TableError)
        try:
            sums = np.frombuffer(raw[12 + hl:], dtype="<u4")
            if len(sums) != head["blocks"]:
                raise ValueError(f"{len(sums)} sums, the header says {head['blocks']}")
        except (ValueError, KeyError, TypeError) as e:
            raise TableError(f"{sc} is corrupt ({str(e).splitlines()[0]}); {fix}") from None
        offset, fid = header_id(path)
        if (head["file_id"], head["file_bytes"]) != (fid, path.stat().st_size) or head["data_offset"] != offset:
            if head["file_id"] == fid:
                raise TableError(f"{path} is truncated or padded ({path.stat().st_size:,} bytes, its checksums "
                                 f"describe {head['file_bytes']:,}); {FIX}")
            warnings.warn(f"{sc.name} describes another version of {path.name}: its rows are not verified",
                          UnverifiedTableWarning, stacklevel=3)
            return None
        return cls(path, sums, offset, head["block_bytes"])

    def check_rows(self, rows: torch.Tensor, tensor_offset: int, row_bytes: int) -> None:
        """Verify the not yet verified blocks holding `rows` (N,) of a tensor at `tensor_offset` in the data."""
        if self.unverified == 0:
            return  # every block checked once: nothing left to do on any later read
        if self.block_bytes % row_bytes == 0 and tensor_offset % row_bytes == 0:  # rows never straddle blocks
            rpb, base = self.block_bytes // row_bytes, tensor_offset // row_bytes
            kernel = _KERNELS.get() if rpb & (rpb - 1) == 0 and rows.dtype == torch.int64 else None
            if kernel is not None and kernel(rows.numpy(), base, rpb.bit_length() - 1, self.ok.numpy()) < 0:
                return  # one fused pass found every row's block already checked
            blocks = (rows + base) // rpb
        else:
            blocks = self.blocks_of(rows, tensor_offset, row_bytes)
        ok = self.ok.index_select(0, blocks)
        if bool(ok.all()):
            return
        for b in torch.unique(blocks[~ok]).tolist():
            self._check(b, row_bytes, tensor_offset)

    def check_bytes(self, start: int, nbytes: int) -> None:
        """Verify every block holding data bytes [start, start + nbytes) (offsets in the data section)."""
        for b in range(start // self.block_bytes, (start + nbytes - 1) // self.block_bytes + 1):
            if not self.ok_np[b]:
                self._check(b)

    def blocks_of(self, rows: torch.Tensor, tensor_offset: int, row_bytes: int) -> torch.Tensor:
        """The blocks holding `rows` (N,) of a tensor at `tensor_offset` in the data: (2N,), first and last of each."""
        return torch.cat(row_span(rows, row_bytes, tensor_offset, self.block_bytes))

    def _check(self, b: int, row_bytes: int = 0, tensor_offset: int = 0) -> None:
        lo = b * self.block_bytes
        self._verify(b, self.data[lo: lo + self.block_bytes], row_bytes, tensor_offset)

    def _verify(self, b: int, data, row_bytes: int = 0, tensor_offset: int = 0) -> None:
        """Compare block `b`'s bytes `data` with its sum: mark it checked, or raise naming its rows."""
        if block_crc(data) != int(self.sums[b]):
            self.fail(b, row_bytes, tensor_offset)
        with self._lock:
            if not self.ok_np[b]:
                self.ok_np[b] = True
                self.unverified -= 1

    def fail(self, b: int, row_bytes: int = 0, tensor_offset: int = 0):
        """Raise the one-line error for block `b` failing its checksum, naming its rows when `row_bytes` is given."""
        lo, rows = b * self.block_bytes, ""
        if row_bytes:
            r0 = max(0, (lo - tensor_offset) // row_bytes)
            rows = f"rows {r0:,}-{(lo + self.block_bytes - 1 - tensor_offset) // row_bytes:,} "
        raise TableError(f"{self.path}: {rows}(block {b} of {len(self.sums)}) fail their checksum: the file is "
                         f"corrupt there; {FIX}")

    # ---- for readers that fetch bytes themselves (the disk tier's positioned reads)
    def check_read(self, b0: int, b1: int, data, row_bytes: int = 0, tensor_offset: int = 0) -> None:
        """Verify blocks b0..b1 from their bytes `data`, as read from the file (from `data_offset + b0 * block_bytes`;
        the file's last block may be short)."""
        bb = self.block_bytes
        for b in range(b0, b1 + 1):
            self._verify(b, data[(b - b0) * bb:(b - b0 + 1) * bb], row_bytes, tensor_offset)

    def verify_all(self) -> None:
        """Check every block now (`engram verify`); a TableError names the bad blocks and their rows."""
        bad = self.check_all()
        if bad:
            raise TableError(f"{self.path}: {len(bad)} of {len(self.sums)} blocks fail their checksum (first: block "
                             f"{bad[0]}, file bytes {self.data_offset + bad[0] * self.block_bytes:,}+); {FIX}")

    def check_all(self) -> list[int]:
        """Every block not yet verified, checked now; returns the bad blocks (for `engram verify`)."""
        bad = []
        for b in (~self.ok).nonzero().squeeze(1).tolist():
            try:
                self._check(b)
            except TableError:
                bad.append(b)
        return bad
