"""Shared timing helper of the benchmarks: median wall time of repeated calls after one warm-up."""

import statistics
import time


def timeit(fn, repeats: int = 10) -> float:
    fn()  # warm up (compiles, allocates, fills caches)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
