"""What a GPU lease runs, checked on the CPU (issue #41): benchmarks/gpu_check.sh's dry run (its
cheapest stages), the per-kernel timeline tool, the merge of its files and of an MLM training-step
run, and the hf-compile rival's torch.compile mode."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bert_fast.bench import results

ROOT = Path(__file__).resolve().parents[2]


def _timeline_module():
    spec = importlib.util.spec_from_file_location("gpu_timeline", ROOT / "benchmarks" / "model" / "gpu_timeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hf_compile_mode():
    from bert_fast.bench.model_providers import HF_COMPILE_MODES, hf_compile_mode

    assert hf_compile_mode("cpu", True) is None and hf_compile_mode("cpu", False) is None  # the CPU: unchanged
    assert hf_compile_mode("cuda", True) == "reduce-overhead"
    assert hf_compile_mode("cuda:0", False) == "max-autotune-no-cudagraphs"
    assert set(HF_COMPILE_MODES) == {None, "reduce-overhead", "max-autotune-no-cudagraphs"}


def test_timeline_case_names():
    tl = _timeline_module()
    assert tl.parse_case("fwd-1x128-graphs") == dict(
        name="fwd-1x128-graphs", mode="fwd", batch=1, seq=128, extra="graphs"
    )
    assert tl.parse_case("train-8x512")["mode"] == "train"
    with pytest.raises(SystemExit, match="expected"):
        tl.parse_case("fwd-32by128")


def test_merge_keeps_train_mlm_runs_and_notes(tmp_path):
    mlm = {"kind": "train-mlm", "model": "tiny", "batch": 2, "seq": 8, "results": {"bert_fast": {"median_ms": 1.0}}}
    (tmp_path / "model-train.json").write_text(json.dumps(mlm))
    doc = results.merge(
        tmp_path / "out.json", run_dir=tmp_path, model_jsons=[tmp_path / "model-train.json"], notes=["n"]
    )
    assert doc["model"]["runs"] == [] and doc["notes"] == ["n"]
    (run,) = doc["model"]["train_mlm"]
    assert run["results"]["bert_fast"]["median_ms"] == 1.0 and run["file"] == "model-train.json"


def test_gpu_check_dry_run(tmp_path):
    """The measure plan's dry run restricted to its cheapest stage: it runs in a temporary copy of the
    tree, records every stage (cuda-build "skipped: dry run", the others skipped), runs the timeline
    on the CPU, merges one results file and leaves it with its tarball in $OUT, and writes nothing
    into the repository."""
    readme = (ROOT / "README.md").read_bytes()
    before = set(os.listdir(ROOT / "benchmarks" / "results"))
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OUT=str(out),
        PYTHON=sys.executable,
        BERT_FAST_CHECK_PLAN="measure",
        BERT_FAST_CHECK_ONLY="timeline",
        BERT_FAST_CHECK_DRY_DIR=str(tmp_path),
        BERT_FAST_CHECK_FETCH="0",
        BERT_FAST_CHECK_LOG=str(tmp_path / "check.log"),
    )
    r = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    (path,) = out.glob("*-measure.json")
    doc = json.loads(path.read_text())
    stages = {s["name"]: s["status"] for s in doc["stages"]}
    assert stages.pop("timeline") == "ok" and stages.pop("cuda-build").startswith("skipped: dry run")
    assert stages.pop("info") == "skipped: the measure plan (call 1 recorded it)"
    assert {"install", "graphs-1x16-tiny", "dense-4x16-tiny-compile", "dense-4x16-tiny-solo"} <= set(stages)
    assert set(stages.values()) <= {"skipped: not in BERT_FAST_CHECK_ONLY", "skipped: the extension is built here"}
    assert {t["case"] for t in doc["timelines"]} == {"fwd-1x16-graphs", "fwd-1x16", "fwd-4x16", "train-4x16"}
    assert any("dry run" in n for n in doc["notes"])
    with tarfile.open(path.with_name(path.name.replace(".json", ".tar.gz"))) as tar:
        names = tar.getnames()
        timeline = json.load(tar.extractfile(f"benchmarks/results/{path.stem}/timeline/train-4x16.json"))
    assert f"benchmarks/results/{path.name}" in names and "README.md" in names
    assert f"benchmarks/results/{path.stem}/timeline/fwd-4x16.trace.json.gz" in names
    with tarfile.open(path.with_name(path.name.replace(".json", ".tar.gz"))) as tar:
        host = tar.extractfile(f"benchmarks/results/{path.stem}/timeline/fwd-4x16.host.txt").read().decode()
    assert host.startswith("host time per call:") and "(by own time)" in host and "layer_forward" in host
    assert timeline["kernels"] and timeline["kernel_count"] == sum(k["count"] for k in timeline["kernels"])
    assert timeline["wall_ms"] > 0 and abs(sum(k["share"] for k in timeline["kernels"]) - 1) < 1e-6
    assert (ROOT / "README.md").read_bytes() == readme and set(os.listdir(ROOT / "benchmarks" / "results")) == before


def test_host_overhead_tool_times_both_routes():
    """benchmarks/model/host_overhead.py: the kernel path's host code with the kernels stubbed, through
    the dispatcher and with direct calls, the same launches either way, and its own-time table."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "model" / "host_overhead.py"),
            "--rounds",
            "2",
            "--calls",
            "1",
            "--top",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if "us per forward" in line}
    assert set(rows) == {"dispatcher", "direct"}
    launches = {name: line.split(", ")[1] for name, line in rows.items()}
    assert launches["dispatcher"] == launches["direct"] and not launches["direct"].startswith("0 ")
    assert "own time per forward" in r.stdout
