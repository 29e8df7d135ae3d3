"""bert_fast ops: each fused op registered as a torch op in the ``bert_fast`` namespace.

One module per op (registration, validation, dispatch, autograd); kernels live in bert_fast.kernels.
"""
import importlib as _importlib

# TEMPORARY during parallel development: import the op modules that exist. Replaced by explicit
# imports once every op module is in.
__all__ = []
for _name in ("embedding", "linear", "bias_gelu", "residual_layer_norm", "attention"):
    try:
        _mod = _importlib.import_module(f"bert_fast.ops.{_name}")
    except ModuleNotFoundError as _e:
        if _e.name != f"bert_fast.ops.{_name}":
            raise
        continue
    for _pub in getattr(_mod, "__all__", []):
        globals()[_pub] = getattr(_mod, _pub)
        __all__.append(_pub)
