"""Facts about BERT shapes: the presets of known models and the model FLOPs of a forward.

One place for what the benchmark (bert_fast.bench), the training loop (bert_fast.training) and
``bert-fast doctor`` say about a model's size and work. Plain arithmetic on numbers: this module
imports neither torch nor transformers, and nothing of bert_fast. ``config`` arguments are any
object with BertConfig's attribute names (hidden_size, num_hidden_layers, intermediate_size).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

# Known model shapes, as BertConfig keyword arguments: one row per preset, in these columns.
# fmt: off
PRESET_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "type_vocab_size",
)
_PRESET_ROWS = (
    #  name                hidden layers heads  ffn    vocab  positions types
    ("bert-base",          768,   12,    12,   3072,  30522,  512,    2),
    ("bert-large",         1024,  24,    16,   4096,  30522,  512,    2),
    ("minilm",             384,   6,     12,   1536,  30522,  512,    2),  # sentence-transformers/all-MiniLM-L6-v2
    # The other families bert_fast runs (RobertaModel, XLMRobertaModel, ElectraModel,
    # DistilBertModel): their layers are BERT's, so the benchmark measures their shapes as a BERT
    # encoder (RoBERTa's positions start after pad_token_id = 1: 514 rows for 512 tokens; one token type).
    ("roberta-base",       768,   12,    12,   3072,  50265,  514,    1),
    ("xlm-roberta-base",   768,   12,    12,   3072,  250002, 514,    1),
    # google/electra-base-discriminator (embedding_size == hidden_size: no embeddings_project)
    ("electra-base",       768,   12,    12,   3072,  30522,  512,    2),
    # distilbert-base-uncased: BERT-base's width, 6 layers, no token types
    ("distilbert-base",    768,   6,     12,   3072,  30522,  512,    1),
    # the CPU default: small enough that every provider runs in seconds
    ("tiny",               128,   2,     4,    512,   1024,   512,    2),
)
# fmt: on
PRESETS: Dict[str, Dict[str, Any]] = {name: dict(zip(PRESET_FIELDS, shape)) for name, *shape in _PRESET_ROWS}


def kernel_shape(preset: str) -> Dict[str, int]:
    """What one layer's kernels see of a preset: hidden, heads, head_dim, ffn (the FFN width) and
    vocab (``bert-fast doctor`` checks every kernel at these)."""
    p = PRESETS[preset]
    return dict(
        hidden=p["hidden_size"],
        heads=p["num_attention_heads"],
        head_dim=p["hidden_size"] // p["num_attention_heads"],
        ffn=p["intermediate_size"],
        vocab=p["vocab_size"],
    )


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
    total = sum(
        n * flops_per_token(config.hidden_size, config.num_hidden_layers, config.intermediate_size, n) for n in lengths
    )
    return total * (3.0 if mode == "train" else 1.0)
