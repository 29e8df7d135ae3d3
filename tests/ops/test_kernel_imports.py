"""The kernels' import graph runs one way: linear.py -> linear_tma.py -> _linear_common.py.

linear.py and linear_tma.py used to import each other (linear_tma took jit helpers from linear, and
linear imported linear_tma inside a function to dodge the cycle); their shared pieces now live in
kernels/_linear_common.py. Read from the sources (AST), so the test needs no GPU and no Triton run.
"""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _relative_imports(name: str):
    """Modules of this package that kernels/<name>.py imports, anywhere in the file."""
    tree = ast.parse((KERNELS / f"{name}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module)
            else:
                out.update(alias.name for alias in node.names)
    return out


def test_linear_tma_does_not_import_linear():
    assert "linear" not in _relative_imports("linear_tma")
    assert "_linear_common" in _relative_imports("linear_tma")


def test_linear_imports_linear_tma_and_the_common_module_imports_neither():
    assert {"linear_tma", "_linear_common"} <= _relative_imports("linear")
    assert not {"linear", "linear_tma"} & _relative_imports("_linear_common")


def test_shared_helpers_are_one_object():
    from bert_fast.kernels import _linear_common, linear, linear_tma

    for name in ("_act_fwd", "_dot_acc", "_column_halves", "_tile_coords", "_prune_configs", "KIND_DW"):
        assert getattr(linear, name) is getattr(_linear_common, name)
        if hasattr(linear_tma, name):
            assert getattr(linear_tma, name) is getattr(_linear_common, name)
