"""tests/conftest.py ends an xdist worker whose test raised a sticky CUDA error (an illegal address:
every later CUDA call of that process fails), so the rest of the suite runs in a fresh worker instead
of failing one by one (170 tests on the 11-28 lease). Needs pytest-xdist (a GPU lease carries it)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def test_a_worker_with_a_sticky_cuda_error_is_replaced(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "test_sticky.py").write_text(
        textwrap.dedent(
            """
            import os

            def test_faults():
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            def test_plain_failure():
                raise RuntimeError("not a CUDA error")

            def test_later():
                assert os.environ["PYTEST_XDIST_WORKER"]
            """
        )
        + "".join(f"\ndef test_more_{i}():\n    pass\n" for i in range(8))
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(tmp_path),
            "-p",
            "conftest",
            "-p",
            "xdist",
            "-n",
            "2",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfE",
            "--rootdir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert "crashed while running" in out and "test_sticky.py::test_faults" in out, out[-3000:]
    assert "9 passed" in out, out[-3000:]  # test_later and the 8 more: none failed after the fault
    assert out.count("crashed while running") == 1  # a plain failure ends no worker
