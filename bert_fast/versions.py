"""The versions of transformers and peft bert_fast supports and was tested with, and the floor check.

A leaf module (standard library only), so that ``import bert_fast`` can refuse a transformers older
than the floor without importing torch or transformers, and any layer may name versions in its
messages. What bert_fast relies on in those libraries is listed in bert_fast/model/compat.py.
"""

from __future__ import annotations

from importlib import metadata
from typing import Optional

# The oldest transformers CI runs (setup.py's lower bound) and the newest it ran at this commit.
TRANSFORMERS_FLOOR = "4.41.2"
TRANSFORMERS_TESTED = ("4.41.2", "5.24.0")
PEFT_TESTED = ("0.13.2", "0.21.2")


class CompatibilityError(RuntimeError):
    """An installed library changed something bert_fast depends on."""


def installed_version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def tested_range(package: str = "transformers") -> str:
    lo, hi = {"transformers": TRANSFORMERS_TESTED, "peft": PEFT_TESTED}[package]
    return f"{lo} to {hi}"


def describe(package: str = "transformers") -> str:
    """'transformers 5.24.0 (bert_fast is tested with 4.41.2 to 5.24.0)' for messages."""
    return f"{package} {installed_version(package)} (bert_fast is tested with {tested_range(package)})"


def check_transformers_floor(version: Optional[str] = None) -> None:
    """Refuse a transformers older than the floor, naming both (called when bert_fast is imported)."""
    version = installed_version("transformers") if version is None else version
    from packaging.version import Version  # a dependency of transformers

    if version is not None and Version(version) < Version(TRANSFORMERS_FLOOR):
        raise ImportError(
            f"bert_fast needs transformers >= {TRANSFORMERS_FLOOR}, but transformers "
            f"{version} is installed: pip install -U 'transformers>={TRANSFORMERS_FLOOR}'"
        )
