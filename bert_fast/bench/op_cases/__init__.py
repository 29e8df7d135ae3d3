"""Per-op benchmark cases: each module defines cases(device, dtype) -> list[OpCase]."""
