"""Plumbing shared by the optional numba kernels (`pip install 'engram-torch[fast]'`).

Kernels are compiled on first use (cached on disk by numba), so `import engram` stays light; a
missing or broken numba means "not available" and the callers take their torch path. One lock
guards every kernel call: numba's default (workqueue) threading layer is process-wide and must not
be entered from two threads at once (the data pipeline hashes on its own thread while the
optimizer runs).
"""

from __future__ import annotations

import os
import threading

lock = threading.Lock()


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
