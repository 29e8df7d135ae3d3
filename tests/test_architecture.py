"""The shape of the code base, checked (issue 24, ARCHITECTURE.md):

* imports flow one way, cli -> doctor -> bench | training -> model -> ops -> reference, kernels
  import nothing of ours, and no two modules of a package import each other (import-linter
  contracts in pyproject.toml); a planted upward import and a planted cycle are caught;
* every fused path runs the one layer forward (bert_fast/model/layer.py);
* ruff's lint and format checks pass (configured in pyproject.toml).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    pytest.importorskip("importlinter")
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0 and "0 broken" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.parametrize(
    "plant",
    [
        ("bert_fast/ops/attention.py", "from bert_fast.model import layer as _planted  # noqa\n", "ops is not allowed"),
        (
            "bert_fast/model/padding.py",
            "from bert_fast.bench import timing as _planted  # noqa\n",
            "model is not allowed",
        ),
        ("kernels/bias_gelu.py", "import bert_fast.ops as _planted  # noqa\n", "kernels"),
        ("bert_fast/model/masks.py", "from bert_fast.model import modeling as _planted  # noqa\n", "cycle"),
    ],
)
def test_contracts_catch_a_planted_violation(tmp_path, plant):
    pytest.importorskip("importlinter")
    for name in ("bert_fast", "kernels"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path, line, words = plant
    target = tmp_path / path
    target.write_text(target.read_text() + "\n" + line)
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert words.split()[0] in proc.stdout, proc.stdout[-3000:]


def test_every_fused_path_runs_the_one_layer_forward():
    """No second copy of the layer forward: only model/layer.py calls the attention op on a
    layer's QKV and residual_layer_norm on its outputs (the reference oracle aside)."""
    callers = []
    for path in sorted((ROOT / "bert_fast").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("bert_fast/ops/", "bert_fast/bench/", "bert_fast/reference.py", "bert_fast/doctor.py")):
            continue
        text = path.read_text()
        if ".residual_layer_norm(" in text or ".varlen_attention(" in text:
            callers.append(rel)
    assert callers == ["bert_fast/model/layer.py"], callers


@pytest.mark.parametrize("check", [["check"], ["format", "--check", "--diff"]], ids=["lint", "format"])
def test_ruff(check):
    pytest.importorskip("ruff")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *check, "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
