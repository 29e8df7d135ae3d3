"""The CPU A/B variants of benchmarks/cpu_ab.py, one module per family; each registers its variants
(harness.variant) when imported."""

from . import attention, backends, int8, process, tree  # noqa: F401  (registers their variants)
from .harness import VARIANTS, Variant  # noqa: F401
