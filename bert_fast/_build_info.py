"""What was compiled and what will run: bert_fast.build_info()."""

from __future__ import annotations


def build_info() -> dict:
    """Return how bert_fast was built and the versions it runs with.

    Keys: cuda_compiled (bool), cuda_archs (list of CMAKE_CUDA_ARCHITECTURES entries),
    cuda_compiler_version, extension_loaded, torch, triton, torch_cuda (torch's CUDA build).
    """
    import torch

    info: dict = {
        "extension_loaded": False,
        "cuda_compiled": False,
        "cuda_archs": [],
        "cuda_compiler_version": "",
        "extension_error": None,
    }
    try:
        from bert_fast import _C

        native = dict(_C.build_info())
        info.update(native)
        info["cuda_archs"] = [a for a in native["cuda_archs"].split(",") if a]
        info["extension_loaded"] = True
    except ImportError as exc:  # a source checkout that was never built
        info["extension_error"] = str(exc)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    return info
