"""A benchmark figure measured while kernels ran the torch fallback says so (the first GPU check on
an H200 measured bert_fast 3x slower than transformers with every kernel falling back and nothing in
the table said it). The provider's runner here takes a fallback the way _verify.run does; the JSON
record, the table's flags column and the summary line must all name it."""

from __future__ import annotations

import json

from bert_fast.bench.results import flags
from bert_fast.bench.summary import summary_lines
from bert_fast.ops import _verify


def test_fallback_is_flagged_in_json_table_and_summary(tmp_path, monkeypatch, capsys, fake_ceilings):
    from bert_fast import cli
    from bert_fast.bench import model_providers

    _verify.reset()
    real_build = model_providers.build_provider_model

    def build(provider, *a, **k):
        model, runner, notes = real_build(provider, *a, **k)
        if provider != "bert_fast":
            return model, runner, notes

        def falling_back(**inputs):
            _verify._fell_back(("attention", "fwd", (), None))  # what run() does on a kept "fail"
            return runner(**inputs)

        return model, falling_back, notes

    monkeypatch.setattr(model_providers, "build_provider_model", build)
    out_json = tmp_path / "b.json"
    rc = cli.main(
        ["bench", "--model", "tiny", "--batch", "2", "--seq", "16", "--providers", "bert_fast,hf-sdpa",
         "--device", "cpu", "--warmup", "0", "--max-rounds", "2", "--inputs", "1", "--no-progress", "--in-process",
         "--json", str(out_json)]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    (case,) = json.loads(out_json.read_text())["runs"]
    ours, theirs = case["results"]
    assert ours["kernel_fallbacks"] == ["attention fwd"]
    assert "kernel_fallbacks" not in theirs
    assert flags(ours).startswith("torch fallback: attention fwd")
    assert "torch fallback: attention fwd" in out
    assert "NOT the kernels' speed" in "\n".join(summary_lines({"runs": [case]}))
    _verify.reset()


def test_fallback_counts_follow_the_checks(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("BERT_FAST_VERIFY_DIR", str(tmp_path))
    monkeypatch.setenv("BERT_FAST_VERIFY", "first")
    _verify.reset()

    def run(kernel, spec):
        x = torch.arange(4.0)
        return _verify.run(
            "bias_gelu", "fwd", spec, torch.device("cpu"), label="k", dtype=torch.float32,
            kernel=kernel, fallback=lambda keep: x, checks=lambda k, t, keep: [_verify.Check("y", k, t, mag=t.abs())],
        )  # fmt: skip

    run(lambda: torch.arange(4.0), ("fp32", 4))
    assert _verify.fallback_counts() == {}  # a passing kernel is no fallback
    run(lambda: torch.arange(4.0) + 1, ("fp32", 8))  # fails its check
    run(lambda: torch.arange(4.0), ("fp32", 8))  # the verdict: falls back again
    assert _verify.fallback_counts() == {"bias_gelu fwd": 2}
    _verify.reset()
