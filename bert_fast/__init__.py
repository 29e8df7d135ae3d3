"""bert_fast: a fast BERT encoder for NVIDIA GPUs."""
from bert_fast._build_info import build_info

__all__ = ["build_info"]
__version__ = "0.1.0"
