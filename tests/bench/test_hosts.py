"""bert_fast.bench.hosts and the choice of isolation: which runs go solo, and how a worker times a
call (perf_counter on the CPU; CUDA events on a GPU, which only a lease runs)."""

import argparse
import time

import pytest

from bert_fast.bench import hosts
from bert_fast.bench.model_options import solo_mode

pytestmark = pytest.mark.no_kernels("the bench's process plumbing, host side")


def _args(mode="infer", encode=False, in_process=False, solo=False):
    return argparse.Namespace(mode=mode, encode=encode, in_process=in_process, solo=solo)


def test_solo_by_default_on_the_cpu_and_with_solo_on_a_gpu():
    assert solo_mode(_args(), cuda=False)
    assert not solo_mode(_args(), cuda=True)  # GPUs stay in-process unless asked (not yet run on one)
    assert solo_mode(_args(solo=True), cuda=True)
    for args in (_args(mode="train", solo=True), _args(encode=True, solo=True), _args(in_process=True, solo=True)):
        assert not solo_mode(args, cuda=True) and not solo_mode(args, cuda=False)


def test_a_burst_times_short_calls_after_a_lead_and_long_ones_once():
    calls = []

    def step(seconds):
        def run():
            calls.append(seconds)
            time.sleep(seconds)

        return run

    short = hosts._burst(step(0.002))
    assert calls == [0.002] * (1 + hosts.CALLS_PER_BURST) and 1.5 < short < 50
    calls.clear()
    long = hosts._burst(step(hosts.LEAD_BELOW_S + 0.01))
    assert calls == [hosts.LEAD_BELOW_S + 0.01] and long >= (hosts.LEAD_BELOW_S + 0.01) * 1e3


def test_the_case_spec_carries_the_device():
    assert hosts.CaseSpec(None, "tiny", 0, [8], 8, 1, None, "infer").device == "cpu"
    assert hosts.CaseSpec(None, "tiny", 0, [8], 8, 1, None, "infer", device="cuda:1").device == "cuda:1"
