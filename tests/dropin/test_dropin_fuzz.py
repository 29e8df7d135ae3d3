"""The differential fuzzer of the drop-in (tests/dropin/dropin_fuzz.py), one new process per family.

In the suite: a fixed seed and a bounded number of cases per family (BERT_FAST_FUZZ_EXAMPLES,
default 60; BERT_FAST_FUZZ_SEED, default 0), each family within BERT_FAST_FUZZ_BUDGET_S seconds
of cases (default 90). A longer run on demand, e.g. 2,000+ cases:
    BERT_FAST_FUZZ_EXAMPLES=500 BERT_FAST_FUZZ_SEED=7 python -m pytest tests/dropin/test_dropin_fuzz.py -s
or ``python tests/dropin/dropin_fuzz.py --examples 500 --seed 7``. Each family prints its report: how
many cases ran, how many were answered (and with what), and the refusals by reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

EXAMPLES = int(os.environ.get("BERT_FAST_FUZZ_EXAMPLES", "60"))
SEED = int(os.environ.get("BERT_FAST_FUZZ_SEED", "0"))
BUDGET_S = float(os.environ.get("BERT_FAST_FUZZ_BUDGET_S", "90"))
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("family", ("bert", "roberta", "xlm_roberta", "electra", "distilbert"))
def test_fuzz_the_drop_in_against_transformers(family, capsys):
    cmd = [sys.executable, os.path.join(HERE, "dropin_fuzz.py"), "--family", family]
    cmd += ["--examples", str(EXAMPLES), "--seed", str(SEED), "--budget-s", str(BUDGET_S)]
    # The path users run on a CPU: not the Triton interpreter the kernel tests force (conftest).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=BUDGET_S + 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    with capsys.disabled():
        answered = sum(report["answered"].values())
        refused = ", ".join(f"{n} {reason}" for reason, n in report["refused"].items()) or "none"
        print(f"\n[fuzz {family}] {report['cases']} cases, {answered} answered; refused: {refused}")
    assert report["cases"] > 0
    # A fuzzer whose every case ends in a refusal tests nothing: a good share must be answered
    # (at the floor, transformers 4.41, head_mask and relative positions are refused often).
    assert answered >= report["cases"] / 4, report
