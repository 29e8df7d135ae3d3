"""Each op's cases are defined once (issue 44): ``sample_inputs`` of bert_fast/bench/op_cases/<op>.py
feeds the op's tests, the doctor's first-use check and ``bert-fast bench-ops``. Checked here: every
test file of an op (tests/ops/test_<op>*.py) imports that module and calls its sample_inputs."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPS = ("attention", "bias_gelu", "embedding", "linear", "linear_residual_layer_norm", "residual_layer_norm")


def _calls_sample_inputs(source: str, op: str) -> bool:
    """Whether ``source`` imports bert_fast.bench.op_cases.<op> (``from bert_fast.bench.op_cases import
    <op> [as name]``) and calls ``name.sample_inputs(...)``."""
    tree = ast.parse(source)
    names = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "bert_fast.bench.op_cases"
        for a in node.names
        if a.name == op
    }
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "sample_inputs"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in names
        for node in ast.walk(tree)
    )


def test_every_op_module_is_checked():
    modules = {p.stem for p in (ROOT / "bert_fast" / "bench" / "op_cases").glob("*.py")} - {"__init__"}
    assert modules == set(OPS)


def _test_files(op: str) -> list:
    """tests/ops/test_<op>.py and test_<op>_*.py, less those of a longer op name (linear: not
    test_linear_residual_layer_norm.py)."""
    longer = [o for o in OPS if o != op and o.startswith(op)]
    files = sorted((ROOT / "tests" / "ops").glob(f"test_{op}*.py"))
    return [f for f in files if not any(f.stem.startswith(f"test_{o}") for o in longer)]


@pytest.mark.parametrize("op", OPS)
def test_the_op_tests_draw_their_inputs_from_sample_inputs(op):
    files = _test_files(op)
    assert files, f"no tests/ops/test_{op}*.py"
    lacking = [f.name for f in files if not _calls_sample_inputs(f.read_text(), op)]
    assert not lacking, f"{lacking}: not drawing their inputs from bert_fast.bench.op_cases.{op}.sample_inputs"


def test_the_scan_catches_a_file_without_sample_inputs():
    uses = "from bert_fast.bench.op_cases import linear as cases\nx = cases.sample_inputs(4, 8, 16, randn)\n"
    assert _calls_sample_inputs(uses, "linear")
    assert not _calls_sample_inputs(uses, "bias_gelu")  # another op's module
    assert not _calls_sample_inputs(uses.split("\n")[0] + "\nx = torch.randn(4, 16)\n", "linear")  # never called
    assert not _calls_sample_inputs(uses.split("\n")[1], "linear")  # not imported
