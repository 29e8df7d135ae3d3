"""JSON results of the benchmarks: environment, ceilings, arguments and every figure; the record
of one provider in a case (new_record, record_failure, take_timings, fill_speedups) and the table
cells (flags, speedup_text) that ``bert-fast bench``, ``--encode`` and ``bench-ops`` share.

Schema of ``bert-fast bench --json`` (kind "model") and ``bert-fast bench-ops --json`` (kind "ops"):

    {
      "schema": "bert_fast.bench/1",
      "kind": "model" | "ops",
      "created": "2025-01-01T00:00:00Z",
      "status": "complete" | "interrupted",
      "environment": {device, device_type, device_name, device_capability, device_memory_bytes,
                      driver_version, cuda_runtime, python, platform, torch, triton,
                      transformers, bert_fast, git_commit, build_info, env},
      "arguments": {every CLI argument},
      "ceilings": {copy_bandwidth_gbs, copy_bandwidth_ci_gbs, copy_unstable, matmul_tflops,
                   matmul_tflops_ci, matmul_unstable, matmul_dtype, matmul_shape, threads, ...},
      "notes": ["...", ...],
      "threads": torch.get_num_threads() during the run (fixed by --threads),
      "timing": {how: clock, rounds, target, interval methods (bert_fast.bench.timing)},
      # kind "model":
      "runs": [{model, config, batch, seq, lengths, real_tokens, padded_tokens, mode, dtype,
                cuda_graphs, flops_per_token, flops_per_step, parity, timing,
                "results": [{provider, status ("ok" | "skipped" | "error" | ...), error, median_ms,
                             p20_ms, p80_ms, ci_low_ms, ci_high_ms, ci_rel, unstable, mean_ms, min_ms,
                             max_ms, iters, tokens_per_s, tflops, mfu, peak_mem_bytes, peak_mem_mb,
                             speedup_of_bert_fast, speedup_ci, speedup_unstable, ...}]}],
      # kind "ops":
      "cases": [{name, op, label, direction, bound, flops, bytes, params, dtype, timing,
                 "results": [{provider, status, error, median_ms, p20_ms, p80_ms, ci_low_ms,
                              ci_high_ms, ci_rel, unstable, gbs, tflops, pct_of_ceiling,
                              pct_of_ceiling_ci, ceiling, ceiling_unstable, peak_mem_bytes,
                              speedup_of_bert_fast, speedup_ci, speedup_unstable, ...}]}]
    }

``python -m bert_fast.bench.results merge ...`` (used by benchmarks/gpu_check.sh) combines the
files of one GPU run into benchmarks/results/<date>-<gpu>-<commit>.json (schema
"bert_fast.gpu_check/1"): environment, tests (pytest counts), stages, ops, model, plots.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from bert_fast import onednn_caches
from bert_fast.bench.summary import (  # noqa: F401 - the summary's names, also reachable from here
    SUMMARY_COS_EPS,
    is_ours,
    summarize_case,
    summary_case_label,
    summary_lines,
    summary_text,
)

SCHEMA = "bert_fast.bench/1"
GPU_CHECK_SCHEMA = "bert_fast.gpu_check/1"

REPO_ROOT = Path(__file__).resolve().parents[2]

MODEL_RUN_KEYS = (
    "model",
    "config",
    "batch",
    "seq",
    "lengths",
    "real_tokens",
    "padded_tokens",
    "mode",
    "dtype",
    "cuda_graphs",
    "flops_per_token",
    "flops_per_step",
    "parity",
    "results",
)
# What every provider's record holds, model or ops: its head, its first figures, its last ones.
_MEDIAN = ("median_ms", "p20_ms", "p80_ms")
_SPEEDUP = ("speedup_of_bert_fast", "speedup_ci", "speedup_unstable")
_RESULT_HEAD = ("provider", "status", "error", *_MEDIAN)
MODEL_RESULT_KEYS = (
    *_RESULT_HEAD,
    "tokens_per_s",
    "tflops",
    "mfu",
    "peak_mem_bytes",
    "peak_mem_mb",
    "speedup_of_bert_fast",
)
OPS_CASE_KEYS = ("name", "op", "label", "direction", "bound", "flops", "bytes", "params", "dtype", "results")
OPS_RESULT_KEYS = (*_RESULT_HEAD, "gbs", "tflops", "pct_of_ceiling", "peak_mem_bytes")
TOP_KEYS = ("schema", "kind", "created", "status", "environment", "arguments", "ceilings", "notes")
ENV_KEYS = (
    "device",
    "device_type",
    "device_name",
    "driver_version",
    "python",
    "torch",
    "triton",
    "transformers",
    "bert_fast",
    "git_commit",
    "build_info",
)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_commit(root: Optional[Path] = None) -> str:
    """``git rev-parse HEAD`` of the source tree (marked ``+dirty`` with local changes), or "unknown".
    BERT_FAST_CHECK_COMMIT, where set, wins: a leased GPU gets the tree over an older .git."""
    if os.environ.get("BERT_FAST_CHECK_COMMIT"):
        return os.environ["BERT_FAST_CHECK_COMMIT"]
    root = Path(root or REPO_ROOT)
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return "unknown"
        commit = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if dirty.returncode == 0 and dirty.stdout.strip():
            commit += "+dirty"
        return commit or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def driver_version() -> Optional[str]:
    """The NVIDIA driver version (nvidia-smi, else /proc/driver/nvidia/version), None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Kernel Module\s+([0-9.]+)", text) or re.search(r"\s([0-9]{3,}\.[0-9.]+)\s", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    return None


def _version(mod: str) -> Optional[str]:
    try:
        m = __import__(mod)
        return getattr(m, "__version__", None)
    except Exception:  # noqa: BLE001 - a broken optional import must not kill the report
        return None


def environment(device=None) -> Dict[str, Any]:
    """Where the figures come from: device, driver, versions, commit, build."""
    import torch

    import bert_fast

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    env: Dict[str, Any] = {"device": str(device), "device_type": device.type}
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        env.update(
            device_name=props.name,
            device_capability=f"{props.major}.{props.minor}",
            device_memory_bytes=int(props.total_memory),
            device_sm_count=int(props.multi_processor_count),
            driver_version=driver_version(),
            cuda_runtime=torch.version.cuda,
        )
    else:
        env.update(
            device_name=platform.processor() or platform.machine() or "cpu",
            device_capability=None,
            device_memory_bytes=None,
            driver_version=None,
            cuda_runtime=torch.version.cuda,
            cpu_threads=torch.get_num_threads(),
        )
    try:
        build = bert_fast.build_info()
    except Exception as exc:  # noqa: BLE001
        build = {"error": str(exc)}
    env.update(
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        triton=_version("triton"),
        transformers=_version("transformers"),
        bert_fast=getattr(bert_fast, "__version__", None),
        git_commit=git_commit(),
        build_info=build,
        env={
            k: os.environ.get(k)
            # oneDNN's cache bounds (bert_fast.onednn_caches sets them at import unless given)
            for k in ("TRITON_INTERPRET", "BERT_FAST_BACKEND", "CUDA_VISIBLE_DEVICES", *onednn_caches.VARIABLES)
            if k in os.environ
        },
    )
    return env


def new_document(
    kind: str, device, arguments: Dict[str, Any], ceilings: Dict[str, Any], notes: List[str]
) -> Dict[str, Any]:
    return {
        "schema": SCHEMA,
        "kind": kind,
        "created": now_iso(),
        "status": "running",
        "environment": environment(device),
        "arguments": arguments,
        "ceilings": ceilings,
        "notes": list(notes),
    }


def _jsonable(obj):
    import math

    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def run_document(kind: str, device, args, ceilings: Dict[str, Any], notes: List[str]) -> Dict[str, Any]:
    """The document of a ``bert-fast bench`` / ``bench-ops`` run: every argument of ``args`` (its
    defaults filled, the device resolved), the thread count and how the timing was done."""
    from bert_fast.bench.timing import method_description

    arguments = {k: v for k, v in vars(args).items() if k not in ("func", "handler")}
    arguments["device"] = str(device)
    doc = new_document(kind, device, arguments, ceilings, notes)
    doc["threads"] = args.threads
    doc["timing"] = method_description(
        device,
        warmup=args.warmup,
        min_rounds=args.min_rounds,
        max_rounds=args.max_rounds,
        target=args.target,
        budget_s=args.max_seconds,
        flush_l2=getattr(args, "flush_l2", False),
    )
    return doc


def close_document(doc: Dict[str, Any], interrupted: bool, started: float) -> None:
    """The run's status ("complete" or "interrupted") and its wall time since ``started``
    (a time.perf_counter() reading)."""
    doc["status"] = "interrupted" if interrupted else "complete"
    doc["wall_seconds"] = time.perf_counter() - started


def publish(
    doc: Dict[str, Any],
    table: Optional[str],
    notes: List[str],
    json_path,
    plot_path,
    plot,
    what: str = "figures",
    summary: bool = False,
) -> None:
    """Print the table and the notes, write the JSON (``json_path``) and the plot (``plot_path``
    through ``plot(doc, path)``, which returns True or the list of files it wrote), each when asked
    for; with ``summary``, end with summary_lines(doc), the part a person reads first."""
    if table is not None:
        print(table)
    for n in notes:
        print(f"note: {n}")
    if json_path:
        write_json(json_path, doc)
        print(f"wrote {json_path}")
    if plot_path:
        try:
            wrote = plot(doc, plot_path)
        except Exception as exc:  # noqa: BLE001 - a plot must never lose the figures
            print(f"plot not written ({one_line(exc)})", file=sys.stderr)
            wrote = False
        if wrote:
            for p in [plot_path] if wrote is True else wrote:
                print(f"wrote {p}")
        else:
            print(f"no successful {what} to plot; {plot_path} not written", file=sys.stderr)
    if summary:
        lines = summary_lines(doc)
        if lines:
            print("")
            print("\n".join(lines))


def write_json(path, doc: Dict[str, Any]) -> None:
    """Write ``doc`` atomically (a partial run never leaves half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(doc), indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path) -> Dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------- one provider's record
# The figures of a provider's record, None until measured, by kind of document (the schema above).
RECORD_FIELDS = {
    "model": (
        *_MEDIAN,
        "mean_ms",
        "min_ms",
        "max_ms",
        "ci_low_ms",
        "ci_high_ms",
        "ci_level",
        "ci_rel",
        "converged",
        "unstable",
        "threads",
        "iters",
        "method",
        "tokens_per_s",
        "padded_tokens_per_s",
        "tflops",
        "mfu",
        "peak_mem_bytes",
        "peak_mem_mb",
        *_SPEEDUP,
    ),
    "ops": (
        *_MEDIAN,
        "ci_low_ms",
        "ci_high_ms",
        "ci_rel",
        "unstable",
        "gbs",
        "tflops",
        "pct_of_ceiling",
        "pct_of_ceiling_ci",
        "ceiling",
        "ceiling_unstable",
        "peak_mem_bytes",
        *_SPEEDUP,
    ),
}


def new_record(provider: str, kind: str = "model") -> Dict[str, Any]:
    """A provider's record in a case of a ``kind`` ("model" or "ops") document: status "ok" and
    no figure yet (a model record also carries the provider's notes)."""
    head: Dict[str, Any] = {"provider": provider, "status": "ok", "error": None}
    if kind == "model":
        head["notes"] = []
    return {**head, **dict.fromkeys(RECORD_FIELDS[kind])}


def error_text(exc: BaseException) -> str:
    """An exception as a record's "error": its type and message, at most 2000 characters."""
    return f"{type(exc).__name__}: {exc}"[:2000]


def one_line(exc: BaseException) -> str:
    """An exception's type and the first line of its message (for the log on stderr)."""
    msg = f"{type(exc).__name__}: {exc}"
    return msg.splitlines()[0] if msg else msg


def record_failure(
    rec: Dict[str, Any], exc: BaseException, *, where: str = "", log: bool = True, with_traceback: bool = False
) -> None:
    """Mark ``rec``: "skipped" with the first line of the reason when the provider cannot run here
    (bert_fast.bench.timing.ProviderUnavailable), else "error" with the exception (and its
    traceback when asked); ``log``: one line on stderr, after ``where`` (a case's name)."""
    from bert_fast.bench.timing import ProviderUnavailable

    if isinstance(exc, ProviderUnavailable):
        rec.update(status="skipped", error=(str(exc).splitlines() or ["unavailable"])[0])
        what = f"skipped: {rec['error']}"
    else:
        rec.update(status="error", error=error_text(exc))
        if with_traceback:
            import traceback

            rec["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=6))[-3000:]
        what = f"FAILED: {one_line(exc)}"
    if log:
        print(f"  {where}{rec['provider']}: {what}", file=sys.stderr)


def take_timings(m, records: Dict[str, Dict[str, Any]], **failure) -> List[str]:
    """Copy each provider's figures from ``m`` (a bert_fast.bench.timing.Measurement) into its
    record, keeping the peak memory measured at its first call; a provider ``m`` skipped or that
    raised while timed goes through record_failure(rec, exc, **failure). Returns the providers timed."""
    from bert_fast.bench.timing import ProviderUnavailable

    timed = []
    for provider, rec in records.items():
        if provider in m.skipped:
            record_failure(rec, ProviderUnavailable(m.skipped[provider]), **failure)
        elif provider in m.errors:
            record_failure(rec, m.errors[provider], **failure)
        elif provider in m.timings:
            peak = rec["peak_mem_bytes"]
            rec.update(m.timings[provider].to_dict())
            rec["peak_mem_bytes"] = peak
            timed.append(provider)
    return timed


def fill_speedups_of(case: Dict[str, Any], m, subject: str, key: str) -> None:
    """case[key] = {provider: speedup of ``subject`` over it, with its interval}, from the same rounds
    (nothing when ``subject`` did not run)."""
    res = case.get("results", [])
    if m is None or not any(r["provider"] == subject and r["status"] == "ok" for r in res):
        return
    case[key] = {}
    for r in res:
        if r["provider"] == subject or r["status"] != "ok" or r.get("median_ms") is None:
            continue
        sp = m.speedup(subject, r["provider"])
        if sp is not None:
            case[key][r["provider"]] = {"value": sp.value, "ci": [sp.ci_low, sp.ci_high], "unstable": sp.unstable}


def fill_speedups(case: Dict[str, Any], m=None, subject: str = "bert_fast", frozen: Optional[str] = None) -> None:
    """speedup_of_bert_fast = provider median / ``subject``'s median (> 1: the subject is faster),
    with the interval of the paired rounds (bert_fast.bench.timing.Measurement.speedup), in every
    record of ``case``, and case["speedups"]; with ``frozen`` (a provider's name) also
    case["speedups_frozen"]: that provider against every other, from the same rounds."""
    res = case.get("results", [])
    bf = next((r for r in res if r["provider"] == subject and r["status"] == "ok"), None)
    for r in res:
        ok = r["status"] == "ok" and bf is not None and r.get("median_ms") is not None
        r["speedup_of_bert_fast"] = r["speedup_ci"] = r["speedup_unstable"] = None
        if not ok:
            continue
        if r is bf:
            r["speedup_of_bert_fast"] = 1.0
            continue
        sp = m.speedup(subject, r["provider"]) if m is not None else None
        if sp is None:
            continue
        r["speedup_of_bert_fast"] = sp.value
        r["speedup_ci"] = [sp.ci_low, sp.ci_high]
        r["speedup_unstable"] = sp.unstable
    case["speedups"] = {
        r["provider"]: r["speedup_of_bert_fast"]
        for r in res
        if r["provider"] != subject and r.get("speedup_of_bert_fast") is not None
    }
    frozen_ok = frozen is not None and any(r["provider"] == frozen and r["status"] == "ok" for r in res)
    if m is not None and frozen_ok and subject != frozen:
        case["speedups_frozen"] = {}
        for r in res:
            if r["provider"] == frozen or r["status"] != "ok" or r.get("median_ms") is None:
                continue
            sp = m.speedup(frozen, r["provider"])
            if sp is not None:
                case["speedups_frozen"][r["provider"]] = {
                    "value": sp.value,
                    "ci": [sp.ci_low, sp.ci_high],
                    "unstable": sp.unstable,
                }


# ----------------------------------------------------------------------------- table cells
def flags(r: Dict[str, Any]) -> str:
    """The flags column of a record: "unstable", "unstable speedup", "ceiling unstable", "torch
    fallback: <op direction>, ..." (kernels that failed their check ran the torch implementation)."""
    out = []
    if r.get("kernel_fallbacks"):
        out.append("torch fallback: " + ", ".join(r["kernel_fallbacks"]))
    if r.get("unstable"):
        out.append("unstable")
    if r.get("speedup_unstable"):
        out.append("unstable speedup")
    if r.get("ceiling_unstable"):
        out.append("ceiling unstable")
    return ", ".join(out)


def speedup_text(r: Dict[str, Any]) -> str:
    """The speedup column of a record: "1.23x (1.20-1.26)", "1.23x" without an interval, "-"."""
    sp, ci = r.get("speedup_of_bert_fast"), r.get("speedup_ci")
    return "-" if sp is None else (f"{sp:.2f}x ({ci[0]:.2f}-{ci[1]:.2f})" if ci else f"{sp:.2f}x")


# ----------------------------------------------------------------------------- pytest counts
_COUNT_RE = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def parse_pytest_counts(log_text: str) -> Dict[str, int]:
    """passed/failed/skipped/errors/xfailed/xpassed from the last summary line of a pytest log."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "xfailed": 0, "xpassed": 0}
    lines = [ln for ln in log_text.splitlines() if _COUNT_RE.search(ln) and (" in " in ln or "=" in ln)]
    if not lines:
        return {**counts, "summary_found": False}
    for n, what in _COUNT_RE.findall(lines[-1]):
        key = {"error": "errors", "warning": "warnings"}.get(what, what)
        counts[key] = int(n)
    counts["summary_found"] = True
    counts["summary"] = lines[-1].strip().strip("=").strip()
    return counts


def parse_junit_counts(xml_path) -> Optional[Dict[str, int]]:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in tot:
            tot[k] += int(s.get(k, 0))
    return {
        "passed": tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"],
        "failed": tot["failures"],
        "errors": tot["errors"],
        "skipped": tot["skipped"],
        "total": tot["tests"],
    }


# ----------------------------------------------------------------------------- merge (gpu_check)
def merge(
    out_path,
    *,
    run_dir,
    stages_file=None,
    info_json=None,
    ops_json=None,
    model_jsons=(),
    pytest_log=None,
    pytest_xml=None,
    pytest_bench_json=None,
    plot=None,
    doctor_json=None,
    timelines=(),
    notes=(),
) -> Dict[str, Any]:
    """Combine the files of one GPU-check run into one document (schema bert_fast.gpu_check/1).
    ``doctor_json``: the report of ``bert-fast doctor --json``; its summary and every check that
    did not pass go into the document (the whole report stays in its own file beside it).
    ``timelines``: benchmarks/model/gpu_timeline.py's CASE.json files (each one's totals and top
    kernels); ``notes``: lines about the run (its plan, a dry run)."""
    run_dir = Path(run_dir)
    out_dir = Path(out_path).parent  # the document names its files relative to itself
    doc: Dict[str, Any] = {"schema": GPU_CHECK_SCHEMA, "created": now_iso(), "run_dir": str(run_dir)}
    doc["notes"] = list(notes)
    doc["stages"] = _stages(stages_file)
    env = None
    info = _read_part(doc, "info", info_json)
    if info is not None:
        env = info.get("environment")
    doc["tests"] = _test_counts(pytest_log, pytest_xml, out_dir)
    doctor = _read_part(doc, "doctor", doctor_json, lambda rep: _doctor_entry(rep, doctor_json, out_dir))
    ops = _read_part(doc, "ops", ops_json)
    # the environment: of `bert-fast info`, else of the first other file that carries one
    for part in (doctor, ops):
        if part is not None:
            env = env or part.get("environment")
    doc["model"], env = _model_part(model_jsons, out_dir, env)
    _read_part(doc, "pytest_benchmark", pytest_bench_json, _pytest_benchmarks)
    doc["timelines"] = [_timeline_entry(p, out_dir) for p in timelines if Path(p).exists()]
    if env is None:
        try:
            env = environment()
        except Exception as exc:  # noqa: BLE001
            env = {"error": str(exc), "git_commit": git_commit()}
    doc["environment"] = env
    doc["plots"] = _plots(doc, plot, run_dir, out_dir)
    write_json(out_path, doc)
    return doc


def _stages(stages_file) -> List[Dict[str, Any]]:
    """The stages of gpu_check.sh, one "name<TAB>rc<TAB>seconds[<TAB>status]" line each."""
    stages = []
    if stages_file and Path(stages_file).exists():
        for ln in Path(stages_file).read_text().splitlines():
            parts = ln.split("\t")
            if len(parts) >= 3:
                stages.append(
                    {
                        "name": parts[0],
                        "rc": int(parts[1]) if parts[1].lstrip("-").isdigit() else parts[1],
                        "seconds": float(parts[2]),
                        "status": parts[3] if len(parts) > 3 else ("ok" if parts[1] == "0" else "failed"),
                    }
                )
    return stages


def _read_part(doc: Dict[str, Any], key: str, path, entry=None) -> Optional[Any]:
    """doc[key] = entry(the JSON at ``path``) (the JSON itself without ``entry``) and that JSON,
    when the file exists; one that cannot be read is noted as doc[key + "_error"], and the merge
    goes on without it (None)."""
    if not (path and Path(path).exists()):
        return None
    try:
        part = read_json(path)
        doc[key] = part if entry is None else entry(part)
    except (OSError, ValueError) as exc:
        doc[f"{key}_error"] = str(exc)
        return None
    return part


def _test_counts(pytest_log, pytest_xml, out_dir: Path) -> Dict[str, Any]:
    """The pytest counts: from the log's summary line, else from the JUnit XML."""
    tests: Dict[str, Any] = {}
    if pytest_log and Path(pytest_log).exists():
        tests.update(parse_pytest_counts(Path(pytest_log).read_text(errors="replace")))
        tests["log"] = os.path.relpath(pytest_log, out_dir)
    if pytest_xml and Path(pytest_xml).exists():
        junit = parse_junit_counts(pytest_xml)
        if junit is not None:
            tests["junit"] = junit
            if not tests.get("summary_found"):
                tests.update({k: junit[k] for k in ("passed", "failed", "errors", "skipped")})
    return tests


def _doctor_entry(rep: Dict[str, Any], doctor_json, out_dir: Path) -> Dict[str, Any]:
    """What the document keeps of the doctor's report: its verdicts and every check not passed."""
    return {
        "file": os.path.relpath(doctor_json, out_dir),
        "gpu_verdict": rep.get("gpu_verdict"),
        "summary": rep.get("summary"),
        "exit_status": rep.get("exit_status"),
        "problems": [c for c in rep.get("checks", []) if c.get("verdict") in ("fail", "error", "fault")],
    }


def _model_part(model_jsons, out_dir: Path, env):
    """({"runs": every run of the model files, each with its file's arguments, "files": what each
    file was}, ``env`` or the first model file's environment)."""
    runs, model_docs, mlm = [], [], []
    for p in model_jsons:
        if not Path(p).exists():
            continue
        try:
            d = read_json(p)
        except (OSError, ValueError) as exc:
            model_docs.append({"file": str(p), "error": str(exc)})
            continue
        env = env or d.get("environment")
        if d.get("kind") == "train-mlm":  # `bench --mode train-mlm`: one case, its own fields
            mlm.append(dict(d, file=os.path.relpath(p, out_dir)))
            continue
        model_docs.append(
            {
                "file": os.path.relpath(p, out_dir),
                "arguments": d.get("arguments"),
                "status": d.get("status"),
                "ceilings": d.get("ceilings"),
                "notes": d.get("notes"),
            }
        )
        for r in d.get("runs", []):
            runs.append(dict(r, arguments=d.get("arguments")))
    return {"runs": runs, "files": model_docs, "train_mlm": mlm}, env


def _timeline_entry(path, out_dir: Path) -> Dict[str, Any]:
    """A timeline case's totals and its ten largest kernels (the file keeps every one)."""
    try:
        d = read_json(path)
    except (OSError, ValueError) as exc:
        return {"file": os.path.relpath(path, out_dir), "error": str(exc)}
    keep = ("case", "model", "dtype", "wall_ms", "kernel_sum_us", "kernel_count", "busy_span_us", "launch_calls")
    return dict({k: d.get(k) for k in keep}, top=d.get("kernels", [])[:10], file=os.path.relpath(path, out_dir))


def _pytest_benchmarks(pb: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each pytest-benchmark entry: its name, median and IQR in seconds, rounds, extra info."""
    return [
        {
            "name": b.get("fullname") or b.get("name"),
            "median_s": b.get("stats", {}).get("median"),
            "iqr_s": b.get("stats", {}).get("iqr"),
            "rounds": b.get("stats", {}).get("rounds"),
            "extra_info": b.get("extra_info"),
        }
        for b in pb.get("benchmarks", [])
    ]


def _plots(doc: Dict[str, Any], plot, run_dir: Path, out_dir: Path) -> List[str]:
    """The combined plot (when asked for) and every PNG of the run directory, relative to the
    document; a plot that fails is noted as doc["plot_error"]."""
    plots = []
    if plot:
        try:
            from bert_fast.bench.plots import plot_combined

            if plot_combined(doc, plot):
                plots.append(os.path.relpath(plot, out_dir))
        except Exception as exc:  # noqa: BLE001 - a plot must never lose the figures
            doc["plot_error"] = f"{type(exc).__name__}: {exc}"
    for extra in sorted(run_dir.glob("*.png")):
        rel = os.path.relpath(extra, out_dir)
        if rel not in plots:
            plots.append(rel)
    return plots


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m bert_fast.bench.results",
        description="Merge the files of one GPU-check run (benchmarks/gpu_check.sh).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge")
    m.add_argument("--out", required=True)
    m.add_argument("--run-dir", required=True)
    m.add_argument("--stages")
    m.add_argument("--info")
    m.add_argument("--ops")
    m.add_argument("--model", nargs="*", default=[])
    m.add_argument("--pytest-log")
    m.add_argument("--pytest-xml")
    m.add_argument("--pytest-bench")
    m.add_argument("--plot")
    m.add_argument("--doctor", help="bert-fast doctor --json report")
    m.add_argument("--timelines", nargs="*", default=[], help="benchmarks/model/gpu_timeline.py CASE.json files")
    m.add_argument("--note", action="append", default=[], help="a line about the run (repeatable)")
    c = sub.add_parser("counts", help="print pytest counts parsed from a log")
    c.add_argument("log")
    args = p.parse_args(argv)
    if args.cmd == "counts":
        print(json.dumps(parse_pytest_counts(Path(args.log).read_text(errors="replace"))))
        return 0
    doc = merge(
        args.out,
        run_dir=args.run_dir,
        stages_file=args.stages,
        info_json=args.info,
        ops_json=args.ops,
        model_jsons=args.model,
        pytest_log=args.pytest_log,
        pytest_xml=args.pytest_xml,
        pytest_bench_json=args.pytest_bench,
        plot=args.plot,
        doctor_json=args.doctor,
        timelines=args.timelines,
        notes=args.note,
    )
    t = doc.get("tests", {})
    if doc.get("doctor"):
        print(f"doctor: {doc['doctor'].get('summary')}")
    print(
        f"wrote {args.out}: tests passed={t.get('passed')} failed={t.get('failed')} "
        f"skipped={t.get('skipped')} errors={t.get('errors')}; {len(doc['model']['runs'])} model runs, "
        f"{len(doc['model']['train_mlm'])} train-mlm, {len(doc['timelines'])} timelines; "
        f"{len((doc.get('ops') or {}).get('cases', []))} op cases"
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main())


def default_plot_path(json_path) -> Path:
    """Where the plot goes when --plot is not given: beside the JSON, same name, .png."""
    return Path(json_path).with_suffix(".png")
