"""The one timing helper of the run-time choices that pick between two CPU implementations by
measuring them (frozen weights' packing, the fp32 GEMM): interleaved medians."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Tuple


def median_pair(a: Callable[[], Any], b: Callable[[], Any], reps: int) -> Tuple[float, float]:
    """Median seconds of ``a()`` and ``b()``, interleaved (the same machine state for both), after
    one untimed call of each (oneDNN builds its primitive at the first call of a shape)."""
    ta, tb = [], []
    a(), b()
    for _ in range(reps):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb)
