"""setup.py skips the CMake build when bert_fast._C is already built from the same sources and
settings (the README's second install command rebuilt the extension, ~2 min, that the first had
just built). Runs ``python setup.py build_ext --inplace`` in a copy of the build files with a
fake ``cmake`` (records its calls, writes a dummy module) and a fake pybind11, so it takes seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_CMAKE = """#!{python}
import os, sys
from pathlib import Path
log = Path(os.environ["FAKE_CMAKE_LOG"])
with log.open("a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if "--build" in sys.argv:
    out = Path(Path("outdir.txt").read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "_C{suffix}").write_bytes(os.urandom(64))   # every build gives a new module
else:
    arg = next(a for a in sys.argv if a.startswith("-DBERT_FAST_OUTPUT_DIR="))
    Path("outdir.txt").write_text(arg.split("=", 1)[1])
"""


@pytest.fixture()
def tree(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "CMakeLists.txt", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "csrc", src / "csrc")
    for pkg in ("bert_fast", "kernels"):
        (src / pkg).mkdir()
        (src / pkg / "__init__.py").write_text("")
    fakes = tmp_path / "fakes"
    (fakes / "pybind11").mkdir(parents=True)
    (fakes / "pybind11" / "__init__.py").write_text(
        "__version__ = '0.0-fake'\ndef get_cmake_dir():\n    return '/nonexistent'\n"
    )
    cmake = fakes / "cmake"
    cmake.write_text(FAKE_CMAKE.format(python=sys.executable, suffix=sysconfig.get_config_var("EXT_SUFFIX")))
    cmake.chmod(0o755)
    log = tmp_path / "cmake.log"
    # BERT_FAST_CUDA_ARCHS is the setting the test changes: not inherited (gpu_check.sh exports this
    # GPU's arch, 90-real on the H200, and the test's "change" to 90-real was then none)
    drop = ("BERT_FAST_FORCE_BUILD", "PYTHONPATH", "BERT_FAST_CUDA_ARCHS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PATH=f"{fakes}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(fakes), FAKE_CMAKE_LOG=str(log))
    return src, log, env


def _build(src, env, **extra):
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=src,
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def _cmake_calls(log):
    return log.read_text().count("--build") if log.exists() else 0


def test_second_build_is_skipped_and_changes_rebuild(tree):
    src, log, env = tree
    module = src / "bert_fast" / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    _build(src, env)
    assert _cmake_calls(log) == 1 and module.is_file()
    assert module.with_name(module.name + ".stamp").is_file()
    first = module.read_bytes()

    out = _build(src, env)  # nothing changed: no CMake run
    assert _cmake_calls(log) == 1 and "skipping the CMake build" in out
    assert module.read_bytes() == first

    (src / "csrc" / "embedding_cpu.cpp").write_text((src / "csrc" / "embedding_cpu.cpp").read_text() + "\n// x\n")
    _build(src, env)  # a source changed
    assert _cmake_calls(log) == 2

    _build(src, env, BERT_FAST_CUDA_ARCHS="90-real")  # a build setting changed
    assert _cmake_calls(log) == 3
    _build(src, env, BERT_FAST_CUDA_ARCHS="90-real")
    assert _cmake_calls(log) == 3

    module.write_bytes(b"not the module the stamp names")  # the module itself changed
    _build(src, env, BERT_FAST_CUDA_ARCHS="90-real")
    assert _cmake_calls(log) == 4

    _build(src, env, BERT_FAST_CUDA_ARCHS="90-real", BERT_FAST_FORCE_BUILD="1")
    assert _cmake_calls(log) == 5
