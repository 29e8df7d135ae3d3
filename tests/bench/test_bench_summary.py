"""The ten-second summary at the end of ``bert-fast bench`` and its default plot, on synthetic
result records (no model is timed here)."""

from __future__ import annotations

import json

import pytest

from bert_fast.bench import plots, results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rec(provider, ms, cos=None, precision="fp32", sp=None, ci=None, unstable=False):
    r = results.new_record(provider)
    r.update(median_ms=ms, ci_low_ms=ms * 0.97, ci_high_ms=ms * 1.03, precision=precision, unstable=unstable)
    if cos is not None:
        r["accuracy"] = {"min_cosine": cos}
    r["speedup_of_bert_fast"], r["speedup_ci"] = sp, ci
    return r


def case(*records, **extra):
    return {
        "model": "m",
        "model_name": "tiny",
        "mode": "infer",
        "batch": 8,
        "seq": 128,
        "lengths": "full",
        "dtype": "fp32",
        "results": list(records),
        **extra,
    }


def test_compares_with_the_fastest_other_at_equal_or_better_accuracy():
    c = case(
        rec("bert_fast", 100, 1.0),
        rec("bert_fast-int8", 40, 0.995),
        rec("onnxruntime-int8", 30, 0.98, "int8", sp=100 / 30),  # faster, less accurate
        rec("openvino", 50, 0.9999, "bf16", sp=2.0),  # the fair rival of bert_fast-int8
        rec("hf-sdpa", 120, 1.0, sp=1.2),
        speedups_int8={"openvino": {"value": 1.25, "ci": [1.2, 1.3], "unstable": False}},
    )
    s = results.summarize_case(c)
    assert s["ours"]["provider"] == "bert_fast-int8" and s["rival"]["provider"] == "openvino"
    assert s["speedup"] == {"value": 1.25, "ci": [1.2, 1.3], "unstable": False}  # from the paired rounds
    assert s["faster_less_accurate"]["provider"] == "onnxruntime-int8"
    text = results.summary_text({"runs": [c]})
    assert text.startswith("Summary: ")
    line = text.splitlines()[1]
    assert "tiny B=8 S=128 fp32" in line and "bert_fast-int8 40.0 ms" in line and "openvino 50.0 ms bf16" in line
    assert "1.25x (95% 1.20-1.30): bert_fast faster" in line
    assert "faster but less accurate: onnxruntime-int8 30.0 ms int8, cos 0.98000" in line


def test_equal_accuracy_counts_and_a_level_result_says_so():
    c = case(
        rec("bert_fast", 100, 0.9999995),
        rec("onnxruntime", 101, 0.9999990, sp=1.01, ci=[0.97, 1.05]),  # same accuracy within float noise
        rec("openvino", 60, 0.99999, "bf16", sp=0.6, ci=[0.58, 0.62]),  # bf16: less accurate than fp32
    )
    s = results.summarize_case(c)
    assert s["rival"]["provider"] == "onnxruntime" and s["faster_less_accurate"]["provider"] == "openvino"
    assert "1.01x (95% 0.97-1.05): bert_fast level (the interval spans 1)" in results.summary_text({"runs": [c]})


def test_rounding_noise_within_one_precision_is_equal_accuracy_and_graphs_need_graphs():
    """Two bf16 engines whose cosines differ by less than a quarter of bert_fast's own distance to 1
    are level (bert-large on the H200: 0.999975 against 0.999971 left bert_fast without a rival and
    hid a 0.34x); an int8 engine well below is not; against CUDA graphs an eager provider is no
    rival, a graphed one is."""
    bf16 = case(rec("bert_fast", 26.3, 0.999975, "bf16"), rec("hf-sdpa", 8.9, 0.999971, "bf16", sp=0.34))
    assert results.summarize_case(bf16)["rival"]["provider"] == "hf-sdpa"
    worse = case(rec("bert_fast", 26.3, 0.999975, "bf16"), rec("onnxruntime-int8", 8.0, 0.99990, "int8"))
    s = results.summarize_case(worse)
    assert s["rival"] is None and s["faster_less_accurate"]["provider"] == "onnxruntime-int8"
    graphed = dict(rec("bert_fast", 0.64, 0.99999, "bf16"), cuda_graphs=True)
    eager = rec("hf-sdpa", 4.46, 0.99999, "bf16", sp=7.0)
    line = results.summary_lines({"runs": [case(graphed, eager)]})[1]
    assert "no other provider ran with CUDA graphs" in line and "7.00x" not in line
    compiled = dict(rec("hf-compile", 0.75, 0.99999, "bf16", sp=1.18), cuda_graphs=True)
    assert results.summarize_case(case(graphed, eager, compiled))["rival"]["provider"] == "hf-compile"


def test_no_rival_as_accurate_no_interval_and_missing_providers():
    only_worse = case(rec("bert_fast", 10, 1.0), rec("onnxruntime-int8", 5, 0.9, "int8", sp=0.5))
    line = results.summary_lines({"runs": [only_worse]})[1]
    assert "no other provider as accurate" in line and "faster but less accurate: onnxruntime-int8" in line
    # no paired interval recorded: the ratio of medians, said to have none
    c = case(rec("bert_fast-frozen", 10, 1.0), rec("hf-sdpa", 20, 1.0))
    assert "2.00x (no interval): bert_fast faster" in results.summary_text({"runs": [c]})
    # accuracy unknown (an --encode case): the fastest other, whatever its accuracy
    enc = case(
        rec("st+optimize", 8),
        rec("st+optimize+freeze", 7),
        rec("sentence-transformers", 14),
        mode="encode",
        subject="st+optimize",
        frozen_provider="st+optimize+freeze",
        speedups_frozen={"sentence-transformers": {"value": 2.0, "ci": [1.9, 2.1], "unstable": True}},
    )
    line = results.summary_lines({"runs": [enc]})[1]
    assert (
        "tiny encode() of 8 sentences: st+optimize+freeze 7.0 ms" in line and "2.00x (95% 1.90-2.10) unstable" in line
    )
    failed = case(rec("bert_fast", 10, 1.0), dict(rec("hf-sdpa", 20), status="error", median_ms=None))
    assert "nothing to compare" in results.summary_text({"runs": [failed]})
    skipped = case(skipped="estimated 2 h, over the budget")
    assert "skipped (estimated 2 h" in results.summary_text({"runs": [skipped]})
    assert results.summary_lines({"runs": []}) == []


def test_committed_cpu_results_summarize():
    doc = json.loads((results.REPO_ROOT / "benchmarks" / "results" / "cpu" / "bench_cpu.json").read_text())
    lines = results.summary_lines(doc)
    assert len(lines) == 1 + len(doc["runs"]) and all(" vs " in ln for ln in lines[1:])


def test_plot_per_case(tmp_path):
    c = case(
        rec("bert_fast", 100, 1.0), rec("bert_fast-int8", 40, 0.995), rec("openvino", 50, 0.9999, "bf16", unstable=True)
    )
    doc = {"environment": {"device_name": "Fake CPU", "device_type": "cpu"}, "runs": [c, dict(c, batch=1)]}
    written = plots.plot_bench(doc, tmp_path / "b.png")
    assert written == [str(tmp_path / "b.png"), str(tmp_path / "b-speedups.png")]
    assert (tmp_path / "b.png").read_bytes()[:8] == PNG_MAGIC
    assert plots.plot_cases({"runs": [case(dict(rec("bert_fast", 1), status="error"))]}, tmp_path / "x.png") is False
    assert not (tmp_path / "x.png").exists()


def test_publish_prints_the_summary_last_and_writes_the_plot_beside_the_json(tmp_path, capsys):
    c = case(rec("bert_fast", 10, 1.0), rec("hf-sdpa", 20, 1.0, sp=2.0, ci=[1.9, 2.1]))
    doc = {"environment": {}, "runs": [c]}
    js = tmp_path / "r.json"
    results.publish(doc, "TABLE", ["a note"], js, results.default_plot_path(js), plots.plot_bench, summary=True)
    out = capsys.readouterr().out
    assert out.index("TABLE") < out.index("note: a note") < out.index("Summary: ")
    assert out.rstrip().endswith("2.00x (95% 1.90-2.10): bert_fast faster")
    assert f"wrote {tmp_path / 'r.png'}" in out and (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC

    def broken(doc, path):
        raise RuntimeError("no display")

    results.publish(doc, None, [], None, tmp_path / "y.png", broken)
    assert "plot not written (RuntimeError: no display)" in capsys.readouterr().err


@pytest.mark.parametrize("extra, png", [([], True), (["--no-plot"], False)])
def test_bench_writes_the_plot_beside_the_json_by_default(tmp_path, capsys, extra, png):
    from bert_fast import cli

    js = tmp_path / "bench.json"
    argv = [
        "bench",
        "--model",
        "tiny",
        "--batch",
        "1",
        "--seq",
        "8",
        "--providers",
        "bert_fast,hf-eager",
        "--device",
        "cpu",
        "--warmup",
        "0",
        "--min-rounds",
        "2",
        "--max-rounds",
        "3",
        "--inputs",
        "1",
        "--no-progress",
        "--json",
        str(js),
        *extra,
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "bench.png").exists() is png
    assert "Summary: " in out and "tiny B=1 S=8 fp32: bert_fast" in out and "vs hf-eager" in out


def test_the_main_job_keeps_its_json_and_plot(monkeypatch, tmp_path, capsys):
    """`bert-fast bench` with no case options (the README's first command) writes its figures to
    bert-fast-bench-<date>.json, and the plot beside it; any case option or --no-plot leaves it off."""
    from bert_fast import cli
    from bert_fast.bench import model_bench

    seen = {}

    class Stop(Exception):
        pass

    def stop(args):
        seen["json"] = args.json
        raise Stop

    monkeypatch.setattr(model_bench, "build_cases", stop)
    monkeypatch.chdir(tmp_path)
    for argv, named in ((["bench"], True), (["bench", "--no-plot"], False), (["bench", "--batch", "1"], False)):
        with pytest.raises(Stop):
            cli.main([*argv, "--device", "cpu"])
        assert (seen["json"] or "").startswith("bert-fast-bench-") is named, argv
    assert "figures go to bert-fast-bench-" in capsys.readouterr().err
