"""`utils.peak_rss_mib` is the calling process's own peak: a run started by a large parent does not inherit it
(Linux carries ru_maxrss across fork and exec; every test-seed run of the first smollm2-adapt record reported
its driver's 5.8 GiB)."""

import subprocess
import sys

import pytest

from engram.utils import peak_rss_mib


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the inheritance is Linux's")
def test_a_child_does_not_report_its_parents_peak():
    ballast = bytearray(400 * 2**20)  # the parent's peak grows by 400 MiB
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])  # touched, so resident
    parent = peak_rss_mib()
    out = subprocess.run([sys.executable, "-c", "from engram.utils import peak_rss_mib; print(peak_rss_mib())"],
                         capture_output=True, text=True, check=True).stdout
    child = float(out)
    del ballast
    assert parent > 400 and child < parent - 300, (parent, child)
