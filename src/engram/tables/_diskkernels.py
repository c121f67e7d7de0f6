"""The disk tier's compiled kernels (numba, optional: `engram-torch[fast]`), built on first use.

`KERNELS`: `first_cold(rows, ...)`, the first row of a gather that is out of range or cold, in one pass.
`READER`: `(read_rows, gather_small, read_ranges)`, the cold-read loops of `DiskTable` without the GIL.
Their callers and what the arguments mean: `tables/disk.py`.
"""

from __future__ import annotations

from ..jit import LazyKernels


def _build_kernels():
    import numba

    @numba.njit(cache=True, nogil=True)
    def first_cold(rows, num_rows, row_bytes, offset, seen):  # index of the first row out of range or cold, or -1
        for i in range(rows.shape[0]):
            r = rows[i]
            if r < 0 or r >= num_rows:
                return i
            start = r * row_bytes + offset
            if not seen[start // 4096] or not seen[(start + row_bytes - 1) // 4096]:
                return i
        return -1

    return first_cold


def _build_reader():
    """The cold-read loop compiled without the GIL: libc `pread` and zlib `crc32` called through ctypes, so
    `queue_depth` reader threads really run at once (the Python loop holds the GIL between reads)."""
    import ctypes
    import ctypes.util

    import numba

    libc = ctypes.CDLL(None, use_errno=True)
    pread = libc.pread
    pread.restype, pread.argtypes = ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
    crc32 = ctypes.CDLL(ctypes.util.find_library("z")).crc32  # the zlib Python's zlib.crc32 wraps
    crc32.restype, crc32.argtypes = ctypes.c_ulong, [ctypes.c_ulong, ctypes.c_void_p, ctypes.c_uint]

    @numba.njit(nogil=True)
    def read_one(fd, start, row_bytes, out, buf, direct, ok, sums, bb, d0, d_end):
        # One row at file byte `start` -> out (uint8 row); buf: page-aligned scratch; ok/sums/bb/d0/d_end: the
        # block sums (ok empty: none). A row in a block not yet checked is read with its whole block(s), which
        # are checked first. Returns (0, 0), (1, 0) for a short read, or (2, block) for a bad checksum.
        lo, hi, b0, b1 = start, start + row_bytes, -1, -1
        if ok.shape[0]:
            b0, b1 = (start - d0) // bb, (hi - 1 - d0) // bb
            if ok[b0] and ok[b1]:
                b0 = -1
            else:
                lo, hi = d0 + b0 * bb, min(d0 + (b1 + 1) * bb, d_end)
        base, end = lo, hi
        if direct:
            base, end = lo - lo % 4096, (hi + 4095) // 4096 * 4096
        if pread(fd, buf.ctypes.data, end - base, base) < hi - base:
            return 1, 0
        if b0 >= 0:
            for b in range(b0, b1 + 1):
                a = d0 + b * bb - base
                n = min(bb, d_end - d0 - b * bb)
                if crc32(0, buf[a:].ctypes.data, n) != sums[b]:
                    return 2, b
                ok[b] = True
        for k in range(row_bytes):
            out[k] = buf[start - base + k]
        return 0, 0

    # (not cached: numba cannot cache calls through ctypes pointers; the two compile in well under a second)
    @numba.njit(nogil=True)
    def read_rows(fd, rows, part, row_bytes, offset, out, buf, direct, ok, sums, bb, d0, d_end):
        # rows[part] -> out[part] (a reader thread's share). Returns (0, 0), (1, row index) for a short read,
        # (2, block) for a bad checksum.
        for j in range(part.shape[0]):
            i = part[j]
            kind, at = read_one(fd, offset + rows[i] * row_bytes, row_bytes, out[i], buf, direct, ok, sums, bb, d0,
                                d_end)
            if kind:
                return kind, (i if kind == 1 else at)
        return 0, 0

    @numba.njit(nogil=True)
    def gather_small(fd, rows, row_bytes, offset, num_rows, seen, mapped, out, buf, direct, ok, sums, bb, d0, d_end,
                     aligned):
        # A decoding step's few rows in one call: a repeated row copied from its first copy, warm rows from the
        # mapping, cold ones read (`read_one`), their pages then marked warm (`aligned` block sums, or none: a
        # row's pages then lie in checked blocks). Returns (kind, index, rows read, rows warm): kind 0 done,
        # 1 short read, 2 bad checksum (index: the block), 3 row id out of range.
        reads = warm = 0
        for i in range(rows.shape[0]):
            r = rows[i]
            if r < 0 or r >= num_rows:
                return 3, i, reads, warm
            dup = -1
            for j in range(i):
                if rows[j] == r:
                    dup = j
                    break
            if dup >= 0:  # each distinct row read once
                for k in range(row_bytes):
                    out[i, k] = out[dup, k]
                continue
            start = offset + r * row_bytes
            p0, p1 = start // 4096, (start + row_bytes - 1) // 4096
            if seen.shape[0] and seen[p0] and seen[p1]:
                for k in range(row_bytes):
                    out[i, k] = mapped[r, k]
                warm += 1
                continue
            kind, at = read_one(fd, start, row_bytes, out[i], buf, direct, ok, sums, bb, d0, d_end)
            if kind:
                return kind, (i if kind == 1 else at), reads, warm
            reads += 1
            if seen.shape[0] and (aligned or not ok.shape[0]):
                seen[p0] = True
                seen[p1] = True
        return 0, 0, reads, warm

    @numba.njit(nogil=True)
    def read_ranges(fd, rows, ranges, part, row_bytes, offset, out, buf, direct, ok, sums, bb, d0, d_end):
        # ranges[part] (lo, hi, i0, i1: the file bytes [lo, hi) holding rows[i0:i1], see `plan_ranges`) -> out:
        # one read per range, its unchecked blocks checked, then the rows cut out. Returns as `read_rows`.
        for j in range(part.shape[0]):
            lo, hi, i0, i1 = ranges[part[j], 0], ranges[part[j], 1], ranges[part[j], 2], ranges[part[j], 3]
            base, end = lo, hi
            if direct:
                base, end = lo - lo % 4096, (hi + 4095) // 4096 * 4096
            got = pread(fd, buf.ctypes.data, end - base, base)
            need = offset + rows[i1 - 1] * row_bytes + row_bytes - base
            if got < need:
                return 1, i1 - 1
            if ok.shape[0]:
                for b in range((lo - d0) // bb, (min(hi, d_end) - 1 - d0) // bb + 1):
                    if not ok[b]:
                        a = d0 + b * bb - base
                        n = min(bb, d_end - d0 - b * bb)
                        if a + n > got:
                            return 1, i1 - 1
                        if crc32(0, buf[a:].ctypes.data, n) != sums[b]:
                            return 2, b
                        ok[b] = True
            for i in range(i0, i1):
                s = offset + rows[i] * row_bytes - base
                for k in range(row_bytes):
                    out[i, k] = buf[s + k]
        return 0, 0

    return read_rows, gather_small, read_ranges


KERNELS = LazyKernels(_build_kernels)
READER = LazyKernels(_build_reader)
