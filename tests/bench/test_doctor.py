"""``bert-fast doctor`` (bert_fast/doctor.py, issue 16) on the CPU: the table, the JSON report, the
exit status, and a check whose process dies reported as a fault while the rest goes on.

Failures are planted in the check processes with BERT_FAST_DOCTOR_PRELOAD (a file each check
process runs first), at the smallest subset of checks that shows each behaviour.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from bert_fast import doctor

cpu_only = pytest.mark.skipif(
    os.environ.get("BERT_FAST_TEST_DEVICE", "cuda" if __import__("torch").cuda.is_available() else "cpu") != "cpu",
    reason="the CPU run of the doctor (through the interpreter); a GPU session runs `bert-fast doctor` itself",
)


def _doctor(args, tmp_path, preload=None, timeout=300):
    env = dict(os.environ)
    env.pop(doctor.PRELOAD_ENV, None)
    if preload is not None:
        f = tmp_path / "preload.py"
        f.write_text(textwrap.dedent(preload))
        env[doctor.PRELOAD_ENV] = str(f)
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bert_fast", "doctor", "--device", "cpu", "--json", str(report)] + args,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=tmp_path,
    )
    return proc, json.loads(report.read_text()) if report.exists() else None


def test_plan_covers_every_kernel_dtype_shape_layout_direction_and_dropout():
    checks = doctor.plan(gpu=True)
    keys = {(c["op"], c["case"], c["dtype"], c["shape"], c["layout"], c["dropout"], c["direction"]) for c in checks}
    assert len(keys) == len(checks) == 360
    assert {c["op"] for c in checks} == set(doctor.OPS)
    assert {c["dtype"] for c in checks} == {"fp32", "fp16", "bf16"}
    assert {c["shape"] for c in checks} == {"minilm", "bert-base", "bert-large"}
    assert {c["dropout"] for c in checks if c["op"] in doctor.DROPOUT_OPS} == {0.0, doctor.DROPOUT_P}
    assert not any(doctor.skip_reason(c) for c in checks)  # on a GPU nothing is skipped
    cpu = doctor.plan(gpu=False)
    skipped = {(c["op"], c["dtype"]) for c in cpu if doctor.skip_reason(c)}
    assert skipped == {("linear", "bf16"), ("attention", "bf16")}


@cpu_only
def test_doctor_cpu_prints_its_table(tmp_path):
    proc, report = _doctor(
        ["--ops", "linear,bias_gelu", "--dtypes", "bf16", "--shapes", "minilm", "--layouts", "dense"], tmp_path
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for column in doctor.COLUMNS:
        assert column in out
    assert "bias_gelu (Triton interpreter)" in out and " pass " in out
    assert "skipped: the Triton interpreter's bf16 tl.dot is wrong" in out
    assert "a GPU verdict" in out and "needs" in out
    assert report["gpu_verdict"] is False and report["exit_status"] == 0
    assert report["summary"]["pass"] == 2 and report["summary"]["skip"] == 6
    row = next(c for c in report["checks"] if c["op"] == "bias_gelu" and c["direction"] == "fwd")
    assert row["worst"]["err"] <= row["worst"]["bound"] and row["kernel_ms"] > 0 and row["torch_ms"] > 0
    # the precision advice of issue 25: capability, measured rates, the call to use
    assert "precision for CPU inference:" in out and "recommended: " in out and "bert_fast.optimize(model" in out
    prec = report["precision"]
    assert prec["recommendation"]["precision"] in ("bf16", "fp32")
    assert prec["rates"]["fp32"] > 0 and prec["rates"]["bf16"] > 0 and prec["rates"]["seconds"] < 30
    assert prec["capabilities"]["model"] in out


PLANTED = """
    import os, resource
    import bert_fast.kernels.bias_gelu as bg
    import bert_fast.kernels.residual_layer_norm as rln

    real_fwd = bg.bias_gelu_fwd

    def perturbed(x2d, bias, approximate):          # a wrong value: the check fails
        y = real_fwd(x2d, bias, approximate).clone()
        y.view(-1)[0] += 1.0 + y.abs().max()
        return y

    def raising(*args, **kwargs):                   # the kernel raises: an error
        raise RuntimeError("CUDA error: misaligned address (planted)")

    def aborting(*args, **kwargs):                  # the process dies: a fault
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.abort()

    bg.bias_gelu_fwd = perturbed
    bg.bias_gelu_bwd = raising
    rln.residual_layer_norm_bwd = aborting
"""


@cpu_only
def test_doctor_reports_fail_error_and_fault_and_exits_nonzero(tmp_path):
    proc, report = _doctor(
        ["--ops", "bias_gelu,residual_layer_norm", "--dtypes", "fp32", "--shapes", "minilm", "--layouts", "dense"],
        tmp_path,
        preload=PLANTED,
    )
    assert proc.returncode == doctor.EXIT_FAIL, proc.stdout + proc.stderr
    by = {(c["op"], c["dropout"], c["direction"]): c for c in report["checks"]}
    assert len(by) == 6 and report["exit_status"] == doctor.EXIT_FAIL
    fail = by[("bias_gelu", 0.0, "fwd")]
    assert fail["verdict"] == "fail" and "out: error" in fail["reason"]
    error = by[("bias_gelu", 0.0, "bwd")]
    assert error["verdict"] == "error" and "misaligned address (planted)" in error["reason"]
    for p in (0.0, doctor.DROPOUT_P):
        fault = by[("residual_layer_norm", p, "bwd")]
        assert fault["verdict"] == "fault" and "SIGABRT" in fault["reason"], fault
        # the checks after a fault ran in a fresh process
        assert by[("residual_layer_norm", p, "fwd")]["verdict"] == "pass"
    assert report["summary"] == {"pass": 2, "fail": 1, "error": 1, "fault": 2, "skip": 0}
    out = proc.stdout
    assert "[fail] bias_gelu (Triton interpreter) fp32 minilm" in out
    assert "[fault] residual_layer_norm (Triton interpreter)" in out and "killed by SIGABRT" in out
    assert "send the JSON report" in out


def _plans(script: str):
    """(the lease's correctness block, the lease plan, the full plan) of gpu_check.sh."""
    at_once = script[script.index("correctness_at_once() {") :]
    at_once = at_once[: at_once.index("\n}\n")]
    plans = script[script.index('case "$PLAN" in\n    lease)\n') :]
    lease = plans[: plans.index(";;")]
    full = plans[plans.index("    full)\n") :]
    return at_once, lease, full


def test_gpu_check_runs_the_doctor_first_and_merges_its_report(tmp_path):
    """benchmarks/gpu_check.sh runs the doctor before the tests and the benchmarks (the lease plan:
    the doctor and warm in the background beside the tests, all done before the timeline), keeps
    its table (doctor.log) and JSON in the run folder, and the merged results file carries its
    summary and every check that did not pass."""
    from pathlib import Path

    from bert_fast.bench import results

    script = (Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh").read_text()
    at_once, lease, full = _plans(script)
    order = [full.index(k) for k in ("run_stage doctor ", "run_stage tests ", "tune_dispatch ", "grid ")]
    assert order == sorted(order)
    doctor, warm, tests, wait = (
        at_once.index(k) for k in ("run_stage doctor ", "run_stage warm ", "run_stage tests ", "\n    wait\n")
    )
    assert doctor < warm < tests < wait  # started first, and waited for before anything is timed
    statements = [ln.strip() for ln in at_once.replace("\\\n", " ").splitlines()]
    assert [ln.endswith("&") for ln in statements if ln.startswith("run_stage ")] == [True, True, False]
    assert lease.index("correctness_at_once") < lease.index("tune_dispatch")
    assert '"$RUN_DIR/doctor.log"' in script and '--json "$RUN_DIR/doctor.json"' in script
    assert '--doctor "$RUN_DIR/doctor.json"' in script
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    bad = {"id": 3, "op": "attention", "verdict": "fault", "reason": "the check's process died (killed by SIGSEGV)"}
    (run_dir / "doctor.json").write_text(
        json.dumps(
            {
                "gpu_verdict": True,
                "exit_status": 1,
                "summary": {"pass": 1, "fault": 1},
                "checks": [{"id": 2, "op": "linear", "verdict": "pass"}, bad],
                "environment": {"device": "cuda"},
            }
        )
    )
    doc = results.merge(tmp_path / "out.json", run_dir=run_dir, doctor_json=run_dir / "doctor.json")
    assert doc["doctor"]["summary"] == {"pass": 1, "fault": 1} and doc["doctor"]["problems"] == [bad]
    assert doc["doctor"]["file"] == "run/doctor.json"


# ----------------------------------------------------------------------------- precision advice (issue 25)
def _caps(*flags, onednn=None):
    from bert_fast.bench import cpu_caps

    onednn = bool({"amx_bf16", "avx512_bf16"} & set(flags)) if onednn is None else onednn  # as torch reports
    found = {f: f in flags for f in cpu_caps.FLAGS}
    ok, why = cpu_caps._bf16_verdict(found, onednn)
    return {"model": "Test CPU 9000", "flags": found, "mkldnn_bf16": onednn, "bf16": ok, "bf16_reason": why}


def _rates(fp32, bf16, int8):
    return {"fp32": fp32, "bf16": bf16, "bf16_linear": bf16, "bf16_packed": bf16, "int8": int8, "threads": 2}


@pytest.mark.parametrize(
    "flags, rates, precision, int8",
    [
        # AMX: bf16 units, bf16 4x fp32, int8 only 1.1x bf16 -> bf16, no int8 mention
        (("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2"), (0.35, 1.4, 1.5), "bf16", False),
        # AMX with int8 measured 1.5x bf16 -> bf16, int8 mentioned behind its guard
        (("amx_bf16", "amx_int8", "avx512f", "avx2"), (0.35, 1.4, 2.1), "bf16", True),
        # AVX-512 BF16 only (Zen 4)
        (("avx512_bf16", "avx512_vnni", "avx512f", "avx2"), (0.3, 0.6, 0.5), "bf16", False),
        # AVX2 only: no bf16 units -> fp32, bf16 emulated
        (("avx2",), (0.2, 0.05, 0.1), "fp32", False),
        # bf16 units but bf16 measured slower than fp32 -> keep fp32
        (("avx512_bf16", "avx512f", "avx2"), (0.3, 0.25, 0.2), "fp32", False),
    ],
)
def test_precision_recommendation_for_faked_capabilities(flags, rates, precision, int8):
    from bert_fast import doctor_precision as dp

    caps = _caps(*flags)
    rec = dp.recommend(caps, _rates(*rates))
    assert rec["precision"] == precision
    assert rec["call"] == (dp.CALL_BF16 if precision == "bf16" else dp.CALL_FP32)
    assert "freeze=True" in rec["call"] and "Test CPU 9000" in rec["why"][0]
    assert (rec["int8"] is not None) == int8
    if int8:
        assert dp.CALL_INT8 in rec["int8"] and "refuses" in rec["int8"]
    text = " ".join(rec["why"])
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        assert "emulated and slow" in text
    elif precision == "fp32":
        assert "not faster than fp32" in text
    shown = dp.format_report({"capabilities": caps, "rates": _rates(*rates), "recommendation": rec})
    assert "recommended: " + precision in shown and "Test CPU 9000" in shown


def test_precision_recommendation_without_oneDNN_bf16_is_fp32():
    from bert_fast import doctor_precision as dp

    # the CPU lists bf16 units, but this torch's oneDNN does not run bf16 natively: emulated, fp32
    rec = dp.recommend(_caps("avx512_bf16", "avx2", onednn=False), _rates(0.3, 0.9, 0.5))
    assert rec["precision"] == "fp32" and "emulated" in " ".join(rec["why"])


def test_precision_rates_are_measured_quickly():
    from bert_fast import doctor_precision as dp

    rates = dp.measure_rates(shapes=((64, 64, 64),), budget_s=0.01)
    assert rates["fp32"] > 0 and rates["bf16"] > 0 and rates["threads"] == dp.THREADS
    assert rates["per_shape"][0]["m"] == 64
