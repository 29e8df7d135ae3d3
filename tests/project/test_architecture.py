"""The shape of the code base, checked (issue 24, ARCHITECTURE.md):

* imports flow one way, cli -> doctor -> bench | training -> model -> ops -> reference, kernels
  import nothing of ours, and no two modules of a package import each other (import-linter
  contracts in pyproject.toml); a planted upward import and a planted cycle are caught;
* every fused path runs the one layer forward (bert_fast/model/layer.py);
* ruff's lint and format checks pass (configured in pyproject.toml);
* every `from bert_fast... import name`, in the package, the benchmarks and the tests, names something
  that exists, including imports inside functions that only a GPU runs;
* no host function (outside Triton kernel bodies) runs over 80 lines.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def _modules():
    """{dotted name: path} of every module of bert_fast (kernels/ as bert_fast.kernels)."""
    found = {}
    for path in sorted((ROOT / "bert_fast").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "kernels":
            parts = ["bert_fast", *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _underscore_uses(name: str, path: Path, modules: dict):
    """Another module's underscore names that module ``name`` imports or reads as an attribute.
    Private modules of a package (``_dispatch``, ``_verify``, ``_C``) are package-internal and
    allowed by name; what they define is not special."""
    import ast

    tree = ast.parse(path.read_text())
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    aliases, uses = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bert_fast"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules or full == "bert_fast._C":
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_"):
                    uses.append(f"{where}:{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                owner = aliases[node.value.id]
                full = f"{owner}.{node.attr}"
                if owner != name and full not in modules:
                    uses.append(f"{where}:{node.lineno}: {owner}.{node.attr}")
    return uses


def test_no_module_uses_another_modules_underscore_names():
    modules = _modules()
    uses = [u for name, path in modules.items() for u in _underscore_uses(name, path, modules)]
    assert not uses, "give these a public name in the module that owns them:\n" + "\n".join(uses)


def test_the_underscore_scan_catches_a_planted_use(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from bert_fast.ops import torch_impl\nfrom bert_fast.model.layer import _private\nx = torch_impl._dropout_mask\n"
    )
    uses = _underscore_uses("bert_fast.planted", planted, _modules())
    assert len(uses) == 2, uses


def _missing_imports(paths) -> list:
    """`from bert_fast.x import y` statements (anywhere in a file, inside functions too) whose y is
    neither an attribute nor a submodule of bert_fast.x: code only a GPU run reaches would fail there
    (benchmarks/training/bench_train.py imported a `model_flops` that had been renamed)."""
    import ast
    import importlib

    missing = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("bert_fast")
            ):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name == "*" or hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    missing.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
    return missing


def test_every_imported_bert_fast_name_exists():
    paths = [p for d in ("bert_fast", "benchmarks", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    missing = _missing_imports(paths)
    assert not missing, "\n".join(missing)


def test_the_import_scan_catches_a_planted_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from bert_fast.training.loop import model_flops, train_flops\n")
    assert _missing_imports([planted]) == ["planted.py:2: from bert_fast.training.loop import model_flops"]


def _long_host_functions(paths, limit: int = 80) -> list:
    """Functions (methods and nested ones too) longer than ``limit`` lines; Triton kernel bodies
    (decorated with triton.jit or autotune) are exempt: a kernel is one unit the compiler sees."""
    import ast

    long = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any("jit" in ast.unparse(d) or "autotune" in ast.unparse(d) for d in node.decorator_list):
                continue
            if node.end_lineno - node.lineno + 1 > limit:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                long.append(f"{where}:{node.lineno}: {node.name} ({node.end_lineno - node.lineno + 1})")
    return long


def test_no_host_function_over_80_lines():
    """Issue 44: a host function a newcomer can read in one screen; split longer ones into named steps."""
    paths = [p for d in ("bert_fast", "kernels", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    long = _long_host_functions(paths)
    assert not long, "\n".join(long)


def test_the_length_scan_catches_a_planted_function(tmp_path):
    planted = tmp_path / "planted.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(81))
    planted.write_text(f"@triton.jit\ndef kernel():\n{body}\n\ndef host():\n{body}")
    assert [u.split(": ")[1] for u in _long_host_functions([planted])] == ["host (82)"]
