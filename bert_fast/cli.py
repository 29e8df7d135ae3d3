"""The ``bert-fast`` command line (also ``python -m bert_fast``).

    bert-fast info [--device D] [--json PATH|-]      build, device, driver, versions, kernel per op
    bert-fast bench [options]                        model benchmark (see bert-fast bench --help)
    bert-fast bench-ops [options]                    per-op benchmark against measured ceilings
    bert-fast doctor [--json PATH]                   every kernel checked on this machine (run it first)
    bert-fast train ...                              training (bert_fast.training.cli, when present)

The parser is modular: each subcommand is one ``_add_<name>(subparsers)`` function in SUBCOMMANDS,
which registers its arguments and a ``handler(args) -> int``. Heavy imports (torch, transformers)
happen inside the handlers, so ``--help`` is fast.

Hook for ``train``: ``bert-fast train ARGS...`` imports ``bert_fast.training.cli`` lazily and calls
its ``main(argv: list[str]) -> int`` with ARGS (the training CLI owns its parser and its --help).
Alternatively that module may define ``add_arguments(parser)`` and ``run(args) -> int``.
Without that module ``train`` exits 2 saying it is not available.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable, List, Optional

PROG = "bert-fast"
TRAIN_MODULE = "bert_fast.training.cli"


class CLIError(Exception):
    """A user error: printed as 'bert-fast <cmd>: error: ...', exit status 2."""


# ----------------------------------------------------------------------------- info
def gather_info(device_name: Optional[str] = None) -> dict:
    import torch

    import bert_fast
    from bert_fast.bench.model_options import BenchError, resolve_device
    from bert_fast.bench.op_backends import OP_KERNELS, linear_dispatch, op_backend
    from bert_fast.bench.results import environment

    try:
        device = resolve_device(device_name)
    except BenchError as exc:
        raise CLIError(str(exc)) from None
    env = environment(device)
    build = env.get("build_info") or {}
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    ops = {op: {name: op_backend(op, device, dt, build) for name, dt in dtypes.items()} for op in OP_KERNELS}
    lin = {name: linear_dispatch(device, dt) for name, dt in dtypes.items()}
    info = {
        "bert_fast": getattr(bert_fast, "__version__", None),
        "environment": env,
        "kernels": ops,
        "linear_dispatch": lin if any(lin.values()) else None,
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "model_available": _model_available(),
        "native_cpu_passes": _native_cpu_passes(),
    }
    if device.type != "cuda":
        info["note"] = (
            "No CUDA GPU visible: bert_fast's Triton and CUDA kernels need a CUDA GPU; on this "
            "machine every op runs its CPU path shown above."
        )
    return info


def _native_cpu_passes() -> dict:
    from bert_fast.ops import cpu_isa

    try:
        return cpu_isa.native_passes()
    except ValueError as exc:  # a bad BERT_FAST_CPU_ISA
        raise CLIError(str(exc)) from None


def _model_available() -> bool:
    try:
        from bert_fast.bench.model_providers import bert_fast_model_class

        return bert_fast_model_class() is not None
    except Exception:  # noqa: BLE001
        return False


def format_info(info: dict) -> str:
    env = info["environment"]
    b = env.get("build_info") or {}
    lines = [f"bert_fast {info.get('bert_fast')}  (commit {env.get('git_commit')})", ""]
    lines.append("build_info:")
    for k in sorted(b):
        lines.append(f"  {k:<24} {b[k]}")
    lines.append("")
    lines.append("device:")
    lines.append(f"  {'device':<24} {env.get('device')}  ({env.get('device_name')})")
    if env.get("device_type") == "cuda":
        lines.append(f"  {'compute capability':<24} {env.get('device_capability')}")
        mem = env.get("device_memory_bytes")
        lines.append(f"  {'memory':<24} {mem / 2**30:.1f} GiB" if mem else f"  {'memory':<24} ?")
        lines.append(f"  {'driver':<24} {env.get('driver_version') or 'unknown'}")
        lines.append(f"  {'CUDA runtime (torch)':<24} {env.get('cuda_runtime')}")
    else:
        lines.append(f"  {'driver':<24} n/a (no CUDA GPU visible; torch CUDA build: {env.get('cuda_runtime')})")
        lines.append(f"  {'CPU threads':<24} {env.get('cpu_threads')}")
    lines.append("")
    lines.append("versions:")
    for k in ("python", "torch", "triton", "transformers"):
        lines.append(f"  {k:<24} {env.get(k)}")
    lines.append(f"  {'platform':<24} {env.get('platform')}")
    flags = env.get("env") or {}
    lines.append(f"  {'env':<24} " + (", ".join(f"{k}={v}" for k, v in flags.items()) or "-"))
    lines.append(f"  {'bert_fast.BertModel':<24} {'available' if info.get('model_available') else 'not importable'}")
    lines.append("")
    lines.append(f"kernels on {env.get('device')} (which implementation runs, per bert_fast.ops._dispatch):")
    missing = "[op module not present yet]"
    lines.append(f"  {'op':<21} {'fp32':<28} {'fp16':<28} {'bf16'}")
    for op, per in info["kernels"].items():
        cells = [per[k].replace(" " + missing, "") for k in ("fp32", "fp16", "bf16")]
        tail = "  " + missing if any(missing in per[k] for k in per) else ""
        lines.append(f"  {op:<21} {cells[0]:<28} {cells[1]:<28} {cells[2]}{tail}")
    if info.get("linear_dispatch"):
        lines.append("  linear auto dispatch, forward, bert-base GEMMs at M=8192 tokens:")
        for name, per in info["linear_dispatch"].items():
            if per:
                lines.append(f"    {name:<6} " + ", ".join(f"{g}={b}" for g, b in per.items()))
    passes = info.get("native_cpu_passes") or {}
    if passes:
        lines.append("")
        lines.append(
            f"native CPU passes (instruction set each runs; CPU {passes['cpu']}, BERT_FAST_CPU_ISA {passes['cap']}):"
        )
        for name, isa in passes.items():
            if name not in ("cpu", "cap"):
                lines.append(f"  {name:<21} {isa}")
    if info.get("note"):
        lines += ["", "note: " + info["note"]]
    return "\n".join(lines)


def _add_info(sub) -> None:
    p = sub.add_parser(
        "info",
        help="build, device, driver, versions and the kernel that runs for each op",
        description="Print how bert_fast was built, the device, driver and versions, and "
        "which implementation of each op runs on this device.",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the information as JSON ('-': stdout only)")
    p.set_defaults(handler=_run_info)


def _run_info(args) -> int:
    info = gather_info(args.device)
    if args.json == "-":
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(format_info(info))
    if args.json:
        from bert_fast.bench.results import write_json

        write_json(args.json, info)
        print(f"wrote {args.json}")
    return 0


# ----------------------------------------------------------------------------- bench, bench-ops, doctor
def _add_module_command(sub, name: str, module: str, user_error: Callable, help: str, description: str = "") -> None:
    """A subcommand that is a module's ``add_arguments(parser)`` and ``run(args) -> int``: its
    docstring (then ``description``) is the command's description, and the exception class
    ``user_error(module)`` is a user error (exit status 2)."""
    mod = importlib.import_module(module)
    p = sub.add_parser(
        name,
        help=help,
        description=(mod.__doc__ or "").strip() + description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mod.add_arguments(p)

    def handler(args) -> int:
        try:
            return mod.run(args)
        except user_error(mod) as exc:
            raise CLIError(str(exc)) from None

    p.set_defaults(handler=handler)


def _add_bench(sub) -> None:
    _add_module_command(
        sub,
        "bench",
        "bert_fast.bench.model_bench",
        lambda m: m.BenchError,
        help="model benchmark: bert_fast against transformers (eager, sdpa, compile) and ONNX Runtime",
        description="\n\nWith no options: a default for the device present (bert-base, bf16, B=32, "
        "S=128 on CUDA; on the CPU, fp32, bert-base and all-MiniLM-L6-v2 at dense 8x128, ragged "
        "16x256 and 1x128 against transformers SDPA and ONNX Runtime).",
    )


def _add_bench_ops(sub) -> None:
    _add_module_command(
        sub,
        "bench-ops",
        "bert_fast.bench.ops_bench",
        lambda m: m.OpsBenchError,
        help="per-op benchmark: GB/s or TFLOP/s and %% of measured ceilings",
    )


def _add_doctor(sub) -> None:
    _add_module_command(
        sub,
        "doctor",
        "bert_fast.doctor",
        lambda m: ValueError,
        help="check every kernel on this machine against the float64 oracle and plain torch; "
        "--json writes the report to send back",
    )


# ----------------------------------------------------------------------------- train (hook)
def _load_train_module():
    try:
        return importlib.import_module(TRAIN_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name in (TRAIN_MODULE, "bert_fast.training"):
            return None
        raise


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        add_help=False,
        help="train / fine-tune (from bert_fast.training.cli; 'bert-fast train --help' for its options)",
    )
    p.add_argument("train_argv", nargs=argparse.REMAINDER)
    p.set_defaults(handler=lambda args: _run_train(args.train_argv))


def _run_train(argv: List[str]) -> int:
    mod = _load_train_module()
    if mod is None:
        raise CLIError(f"the train subcommand is not available in this build ({TRAIN_MODULE} not found)")
    if hasattr(mod, "main"):
        return int(mod.main(list(argv)) or 0)
    if hasattr(mod, "add_arguments") and hasattr(mod, "run"):
        p = argparse.ArgumentParser(prog=f"{PROG} train")
        mod.add_arguments(p)
        return int(mod.run(p.parse_args(argv)) or 0)
    raise CLIError(f"{TRAIN_MODULE} defines neither main(argv) nor add_arguments(parser) + run(args)")


def _add_prepare_data(sub) -> None:
    from bert_fast.training.prepare import add_prepare_parser  # light: argparse only at import

    add_prepare_parser(sub)


# ----------------------------------------------------------------------------- main
SUBCOMMANDS: List[Callable] = [_add_info, _add_bench, _add_bench_ops, _add_doctor, _add_train, _add_prepare_data]


def build_parser() -> argparse.ArgumentParser:
    import bert_fast

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="bert_fast: a fast BERT encoder for NVIDIA GPUs (Triton + CUDA kernels).",
        epilog="Run 'bert-fast COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {bert_fast.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``bert-fast``; returns the exit status (argparse errors raise SystemExit(2))."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The training CLI owns its arguments (and --help): hand them over untouched.
    if argv and argv[0] == "train":
        try:
            return _run_train(argv[1:])
        except CLIError as exc:
            print(f"{PROG} train: error: {exc}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        print(f"\n{PROG}: error: a command is required (info, bench, bench-ops, doctor, train)", file=sys.stderr)
        return 2
    try:
        return int(args.handler(args) or 0)
    except CLIError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
