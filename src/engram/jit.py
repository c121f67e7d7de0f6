"""Plumbing shared by the optional numba kernels (the `fast` extra): core infrastructure that
every package with a kernel uses (hashing, hyper, tables, training, integrations.vllm).

    LazyKernels(build)        compiles on first `get()`; None when numba is missing or broken
    launch()                  the context every kernel call runs in (below)
    leave_threads_to_host()   for processes whose OpenMP threads another runtime owns (vLLM's workers)
    serial_only()             True after it: callers use a kernel's serial flavor or their torch path

Kernels are compiled on first use (cached on disk by numba), so `import engram` stays light; a
missing or broken numba means "not available" and the callers take their torch path. Every kernel
call goes through `launch()`:

- one lock: numba's threading layers (workqueue in particular) are process-wide and must not be
  entered from two threads at once (the data pipeline hashes on its own thread while the optimizer
  runs);
- as many threads as torch uses (`torch.get_num_threads()`: OMP_NUM_THREADS, `torch.set_num_threads`),
  never more than numba's own limit. numba defaults to every core, and its OpenMP layer's workers
  spin between kernels, and starting them set the shared OpenMP thread count that torch reads too: a
  process limited to one thread (OMP_NUM_THREADS=1) ran torch and the kernels on two, and two such
  processes on 2 cores ran each training step about 5x slower (measured 2026-12-02).
"""

from __future__ import annotations

import contextlib
import os
import threading

lock = threading.Lock()


_host_threads = False  # True where another runtime owns the process's OpenMP threads (`leave_threads_to_host`)


def leave_threads_to_host() -> None:
    """From now on this process's kernels run serially on the calling thread and `launch` never touches a thread
    count: for processes whose OpenMP threads another runtime owns. vLLM's CPU worker binds its threads and ignores
    `torch.set_num_threads`; starting numba's parallel pool there reset the count its attention kernels were
    planned with (with OMP_NUM_THREADS=1 on 2 cores vLLM stopped: "thread_num 1 vs. 2", measured 2026-12-04)."""
    global _host_threads
    _host_threads = True


def serial_only() -> bool:
    """True after `leave_threads_to_host`: callers use a kernel's serial flavor or their torch path."""
    return _host_threads


@contextlib.contextmanager
def launch():
    """Hold the kernels' lock, with numba's thread count for this thread set to torch's (see the module doc);
    after `leave_threads_to_host` only the lock (serial kernels start no pool)."""
    if _host_threads:
        with lock:
            yield
        return
    import numba
    import torch

    with lock:
        t = torch.get_num_threads()  # read before numba's first launch, which can change it (below)
        n = max(1, min(t, numba.config.NUMBA_NUM_THREADS))
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)
        try:
            yield
        finally:  # numba's OpenMP layer shares torch's libgomp: starting its pool set every later region to
            if torch.get_num_threads() != t:  # NUMBA_NUM_THREADS threads, torch's included
                torch.set_num_threads(t)


class LazyKernels:
    """`build()` -> kernels, called once on first `get()`; None when numba is unusable.

    `switchable=True`: the environment variable ENGRAM_FUSED=0 turns the kernels off (torch ops
    only), for kernels whose float rounding differs from the torch path they replace.
    """

    def __init__(self, build, switchable: bool = False):
        self._build, self._switchable = build, switchable
        self._kernels, self._checked = None, False

    def get(self):
        if not self._checked:
            self._checked = True
            if self._switchable and os.environ.get("ENGRAM_FUSED", "1") == "0":
                return None
            try:
                self._kernels = self._build()
            except Exception:  # numba missing or broken: the torch path takes over
                self._kernels = None
        return self._kernels
