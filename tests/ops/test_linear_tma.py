"""The Hopper GEMM of ``linear`` (kernels/linear_tma.py): TMA loads and stores, persistent grid.

On the CPU it runs in the Triton interpreter (BERT_FAST_GEMM_TMA=1 turns it on there), fp32/fp16;
on CUDA where it is used (compute capability >= 9), fp16/bf16 (fp32 stays on the pointer kernel
there). Every test counts the launches of the TMA kernel, so a silent fallback to the pointer
kernel fails it. Tolerance: the 2x rule of DESIGN.md through test_linear's ``_check``.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_linear import ACTS, _check

from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import linear as linear_cases
from bert_fast.kernels import linear as K
from bert_fast.kernels import linear_tma
from bert_fast.testing import assert_close_2x, distinct_tiles, dtypes_for, gpu_config_space, pick_test_device, tile_of

# every test launches one of these kernels (tests/conftest.py counts them) unless marked no_kernels
pytestmark = pytest.mark.kernels("linear_tma")
DEVICE = pick_test_device()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, EPILOGUE_SPLIT): both epilogue variants. In the
# interpreter small tiles, so that the test shapes below span several tiles and a K tail.
CONFIGS = (
    [(32, 32, 32, 4, 1, 1), (32, 32, 32, 4, 1, 2)]
    if DEVICE.type == "cpu"
    else [(64, 64, 64, 4, 3, 1), (128, 128, 64, 8, 3, 2)]
)
# (M, K, N): none a multiple of its tile; K leaves a tail of 8 columns
SHAPE = (70, 40, 48) if DEVICE.type == "cpu" else (300, 200, 264)


@pytest.fixture
def tma_kinds(monkeypatch, device):
    """Forces the TMA kernel (BERT_FAST_GEMM_TMA=1) and records the GEMM kind of every launch. Skips
    only on a GPU without TMA (compute capability < 9); on the CPU the interpreter runs it, and a
    run without the interpreter fails here instead of skipping."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("the TMA GEMM needs compute capability >= 9")
    assert device.type == "cuda" or INTERPRET, "the CPU run must use the Triton interpreter (tests/conftest.py)"
    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "1")
    kinds = []
    launch = linear_tma.launch

    def counting(a, b, y, z, bias, act, kind, *rest):
        kinds.append(kind)
        return launch(a, b, y, z, bias, act, kind, *rest)

    monkeypatch.setattr(linear_tma, "launch", counting)
    # three programs for 9+ tiles: every program walks several tiles (the persistent loop)
    monkeypatch.setattr(linear_tma, "_num_sms", lambda dev: 3)
    return kinds


def _pin_config(monkeypatch, cfg):
    bm, bn, bk, warps, stages, split = cfg
    monkeypatch.setattr(
        linear_tma._linear_tma_kernel, "configs", [linear_tma._cfg(bm, bn, bk, warps, stages, split=split)]
    )


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "x".join(map(str, c[:3])) + f"-split{c[5]}")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", dtypes_for(DEVICE, include_fp32=DEVICE.type == "cpu"))
def test_tma_gemm_forward_and_backward(device, dtype, act, cfg, tma_kinds, monkeypatch):
    """y, dX and dW (all three GEMM layouts: B transposed, plain, A transposed) and db."""
    _pin_config(monkeypatch, cfg)
    m, k, n = SHAPE
    randn = seeded_randn(21, device, dtype)
    x, w, b = linear_cases.sample_inputs(m, n, k, randn, bias_scale=1.0).values()
    _check(x, w, b, act, randn(m, n), "triton")
    assert sorted(tma_kinds) == [K.KIND_FWD, K.KIND_DX, K.KIND_DW]


def test_tma_gemm_no_bias_and_leading_dims(device, tma_kinds, monkeypatch):
    _pin_config(monkeypatch, CONFIGS[-1])
    m, k, n = SHAPE
    randn = seeded_randn(22, device, dtypes_for(DEVICE)[-1])
    x, w, _ = linear_cases.sample_inputs(m, n, k, randn).values()
    _check(x.view(2, m // 2, k), w, None, "gelu_tanh", randn(2, m // 2, n), "triton")
    assert len(tma_kinds) == 3


def test_tma_gemm_transposed_x(device, tma_kinds, monkeypatch):
    """x given as the transpose of a contiguous [K, M] tensor: the forward's A is read transposed
    (M rounded up to a multiple of 8: the pitch of the stored [K, M] must be 16 bytes)."""
    _pin_config(monkeypatch, CONFIGS[0])
    m, k, n = SHAPE
    m = (m + 7) // 8 * 8
    randn = seeded_randn(23, device, dtypes_for(DEVICE)[-1])
    x, w, b = linear_cases.sample_inputs(m, n, k, randn, bias_scale=1.0).values()
    _check(x.t().contiguous(), w, b, "gelu", randn(m, n), "triton", x_view=lambda t: t.t())
    assert K.KIND_FWD in tma_kinds


@pytest.mark.parametrize("split_k", [2, 5])
def test_tma_split_k_weight_gradient(device, tma_kinds, monkeypatch, split_k):
    """dW in K-slices (fp32 partials in a [slices, M, N] workspace, summed in a fixed order): the
    token count M = 70 (CPU) is 3 K-tiles of 32, so 5 slices leave two empty ones (zeros)."""
    _pin_config(monkeypatch, CONFIGS[-1])
    asked = []

    def forced(kind, m, n, k, num_sms):
        asked.append(kind)
        return split_k if kind == K.KIND_DW else 1

    monkeypatch.setattr(linear_tma, "_split_k", forced)
    m, k, n = SHAPE
    randn = seeded_randn(26, device, dtypes_for(DEVICE)[-1])
    x, w, b = linear_cases.sample_inputs(m, n, k, randn, bias_scale=1.0).values()
    _check(x, w, b, "gelu", randn(m, n), "triton")
    assert K.KIND_DW in asked and K.KIND_FWD not in asked  # the forward has an epilogue: never split
    assert sorted(tma_kinds) == [K.KIND_FWD, K.KIND_DX, K.KIND_DW]


def _tile_id(cfg):
    bm, bn, bk, split = tile_of(cfg.kwargs)
    return f"{bm}x{bn}x{bk}-split{split}"


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16] if DEVICE.type == "cpu" else [torch.float16, torch.bfloat16]
)
@pytest.mark.parametrize("cfg", distinct_tiles(gpu_config_space(linear_tma._configs)), ids=_tile_id)
def test_every_autotune_tile_of_the_tma_gemm(device, cfg, dtype, tma_kinds, monkeypatch, kernel_launches):
    """Each tile the TMA GEMM's autotuner may pick on Hopper (kernels/linear_tma.py's list and its
    BERT_FAST_AUTOTUNE=0 choice), pinned as the only config: y (bias + GELU + z), dX and dW at
    M = N = max(BLOCK_M, BLOCK_N) + 8, K = BLOCK_K + 8 (16-byte row pitches): three programs for
    the forward's four or more tiles (the persistent loop), partial last tiles, a K tail; 2x rule vs
    the oracle, and the launch record shows all three GEMMs ran that tile."""
    from bert_fast.kernels.tuned_configs import TunedConfigs

    # judged here against the oracle, tile by tile: the ops' first-use check keys its verdicts on the
    # specialization, not the tile, so a verdict must not carry over from one tile's test to the next
    monkeypatch.setenv("BERT_FAST_VERIFY", "off")
    if device.type == "cpu":  # warps and stages mean nothing to the interpreter
        cfg = linear_tma._cfg(*tile_of(cfg.kwargs)[:3], 4, 1, split=cfg.kwargs["EPILOGUE_SPLIT"])
    monkeypatch.setattr(linear_tma._linear_tma_kernel, "configs", [cfg])
    monkeypatch.setattr(linear_tma, "_TUNED", TunedConfigs(linear_tma._linear_tma_kernel, "t", persist=False))
    bm, bn, bk, split = tile_of(cfg.kwargs)
    s = max(bm, bn) + 8
    randn = seeded_randn(bm + 3 * bn + 7 * bk, device, dtype)
    x, w, b = linear_cases.sample_inputs(s, s, bk + 8, randn, bias_scale=1.0).values()
    _check(x, w, b, "gelu", randn(s, s), "triton")
    assert sorted(tma_kinds) == [K.KIND_FWD, K.KIND_DX, K.KIND_DW]
    ran = [tile_of(t) for t in kernel_launches.tiles("_linear_tma_kernel")]
    assert ran == [(bm, bn, bk, split)] * 3, ran


@pytest.mark.no_kernels("the split-K rule, host side")
def test_split_k_choice():
    """Slices only for dW grids that leave most SMs idle (132 SMs, 128x128 tiles), >= 2048 of K each."""
    dw, dx = K.KIND_DW, K.KIND_DX
    assert linear_tma._split_k(dw, 768, 768, 16384, 132) == 3  # BERT-base attention output: 36 tiles
    assert linear_tma._split_k(dw, 1024, 1024, 16384, 132) == 2  # BERT-large: 64 tiles
    assert linear_tma._split_k(dw, 768, 2304, 16384, 132) == 1  # QKV: 108 tiles
    assert linear_tma._split_k(dw, 768, 768, 4096, 132) == 2  # bounded by K / 2048
    assert linear_tma._split_k(dw, 64, 64, 1 << 20, 132) == 8  # at most 8
    assert linear_tma._split_k(dw, 768, 768, 1024, 132) == 1
    assert linear_tma._split_k(dx, 768, 768, 16384, 132) == 1  # only the weight gradient


# ----------------------------------------------------------------------------- autotune winners on disk
def _two_configs(monkeypatch):
    configs = [linear_tma._cfg(32, 32, 32, 4, 1), linear_tma._cfg(32, 32, 32, 4, 1, split=2)]
    monkeypatch.setattr(linear_tma._linear_tma_kernel, "configs", configs)
    return configs


@pytest.mark.no_kernels("the winners' store, host side")
def test_tuned_configs_persist_across_processes(tmp_path, monkeypatch):
    """Triton skips its disk cache for configs with pre-hooks, so TunedConfigs keeps the winners:
    a new store (the next process) finds them; another config list, a corrupt file or a config that
    is not in the list finds nothing; two writers keep each other's entries; persist=False writes
    nothing."""
    from bert_fast.kernels.tuned_configs import TunedConfigs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    configs = _two_configs(monkeypatch)
    kernel, dev = linear_tma._linear_tma_kernel, torch.device("cpu")
    first, second = TunedConfigs(kernel, "t"), TunedConfigs(kernel, "t")
    assert first.lookup(dev, (1, 2)) is None and second.lookup(dev, (3, 4)) is None
    first.remember(dev, (1, 2), configs[1])
    second.remember(dev, (3, 4), configs[0])  # its in-memory view predates first's write
    files = list((tmp_path / "bert_fast_autotune").glob("t-*.json"))
    assert len(files) == 1
    later = TunedConfigs(kernel, "t")
    assert later.lookup(dev, (1, 2)) is configs[1] and later.lookup(dev, (3, 4)) is configs[0]
    later.remember(dev, (5, 6), linear_tma._cfg(64, 64, 32, 4, 1))  # not one of the list's
    assert later.lookup(dev, (5, 6)) is None

    monkeypatch.setattr(kernel, "configs", configs[::-1])  # another list: another file
    assert TunedConfigs(kernel, "t").lookup(dev, (1, 2)) is None
    monkeypatch.setattr(kernel, "configs", configs)
    files[0].write_text("{not json")
    assert TunedConfigs(kernel, "t").lookup(dev, (1, 2)) is None

    quiet = TunedConfigs(kernel, "quiet", persist=False)
    quiet.remember(dev, (1, 2), configs[1])
    assert quiet.lookup(dev, (1, 2)) is configs[1]
    assert not list((tmp_path / "bert_fast_autotune").glob("quiet-*"))


def test_tma_launch_reuses_the_stored_winner(device, tma_kinds, tmp_path, monkeypatch):
    """The first GEMM of a key goes through the autotuner and records its winner; the next one,
    in this process or a new one, launches that config directly, with the same result."""
    from bert_fast.kernels.tuned_configs import TunedConfigs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    _pin_config(monkeypatch, CONFIGS[-1])
    kernel = linear_tma._linear_tma_kernel
    runs = []
    tuned_run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **kw: runs.append(1) or tuned_run(*a, **kw))
    monkeypatch.setattr(linear_tma, "_TUNED", TunedConfigs(kernel, "linear_tma"))
    m, k, n = SHAPE
    a, w, _ = linear_cases.sample_inputs(m, n, k, seeded_randn(27, device, dtypes_for(DEVICE)[-1])).values()
    b = w.t().contiguous()  # B [K, N], row-major
    outs = []
    for store in ("this process", "this process", "a new process"):
        if store == "a new process":
            monkeypatch.setattr(linear_tma, "_TUNED", TunedConfigs(kernel, "linear_tma"))
        y = torch.empty(m, n, device=device, dtype=a.dtype)
        K._launch_gemm(a, b, y, None, None, 0, K.KIND_FWD)
        outs.append(y)
    assert runs == [1] and len(tma_kinds) == 3
    assert len(list((tmp_path / "bert_fast_autotune").glob("linear_tma-*.json"))) == 1
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_close_2x(outs[0], a.double() @ b.double(), a @ b, name="y")  # the 2x rule, not a 5% band


def test_tma_falls_back_where_tma_cannot_read(device, tma_kinds):
    """What TMA cannot read goes to the pointer kernel, with the right answer:
    K = 7 fp16 rows are 14 bytes (TMA needs 16-byte row pitches): no GEMM of that layer uses TMA;
    x with a column stride of 2 has no unit stride: the forward and dW (which reads x) fall back,
    only dX = dZ @ W (both contiguous) takes the TMA kernel."""
    randn = seeded_randn(24, device, torch.float16)
    x, w, b = linear_cases.sample_inputs(33, 24, 7, randn, bias_scale=1.0).values()
    _check(x, w, b, "gelu", randn(33, 24), "triton")
    assert tma_kinds == []
    x, w, b = linear_cases.sample_inputs(33, 24, 32, randn, bias_scale=1.0).values()
    wide = torch.stack((x, torch.zeros_like(x)), dim=-1).view(33, 64)  # x in the even columns
    _check(wide, w, b, None, randn(33, 24), "triton", x_view=lambda t: t[:, ::2])
    assert tma_kinds == [K.KIND_DX]


@pytest.mark.no_kernels("the TMA eligibility rules, host side")
def test_usable_rules(monkeypatch):
    t = lambda *shape, dt=torch.float16: torch.empty(*shape, dtype=dt)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "1")
    a, b, y = t(64, 32), t(48, 32).t(), t(64, 48)
    assert linear_tma.usable(a, b, y)
    assert linear_tma.usable(t(32, 64).t(), b, y)  # A stored transposed
    assert not linear_tma.usable(t(64, 7), t(48, 7).t(), y)  # 14-byte rows
    assert not linear_tma.usable(t(64, 64)[:, ::2], b, y)  # no unit stride
    shifted = t(64 * 32 + 1)[1:].view(64, 32)  # pitch fine, base 2 bytes off
    assert not linear_tma.usable(shifted, b, y)
    assert not linear_tma.usable(a, b, t(48, 64).t())  # the output must be row-major
    assert not linear_tma.usable(t(1, 32).expand(64, 32), b, y)  # broadcast rows (pitch 0)
    assert not linear_tma.usable(t(64 * 8 + 24).as_strided((64, 32), (8, 1)), b, y)  # overlapping rows
    assert not linear_tma.usable(a, t(1, 48).expand(32, 48), y)  # a broadcast gradient as B
    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "0")
    assert not linear_tma.usable(a, b, y)
    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "auto")  # auto: never in the interpreter
    assert not linear_tma.usable(a, b, y)
    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "yes")
    with pytest.raises(ValueError, match="BERT_FAST_GEMM_TMA"):
        linear_tma.usable(a, b, y)


@pytest.mark.no_kernels("the TMA eligibility rule on CUDA, host side: usable() launches nothing")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA choice needs a GPU")
def test_auto_mode_on_cuda(monkeypatch):
    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "auto")
    dev = torch.device("cuda")
    a = torch.empty(64, 32, device=dev, dtype=torch.bfloat16)
    b = torch.empty(48, 32, device=dev, dtype=torch.bfloat16).t()
    y = torch.empty(64, 48, device=dev, dtype=torch.bfloat16)
    big_smem = linear_tma.smem_per_block(dev) >= 227 * 1024  # H100/H200/B200, not sm_120
    assert linear_tma.usable(a, b, y) == (torch.cuda.get_device_capability()[0] >= 9 and big_smem)
    assert not linear_tma.usable(a.float(), b.float(), y.float())  # fp32 keeps the IEEE pointer GEMM


# ----------------------------------------------------------------------------- sm_90, offline
def _cuobjdump():
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else shutil.which("cuobjdump")


def _loop_depth_of_dots(ttgir: str) -> list[int]:
    """For each MMA of a TTGIR listing, how many scf.for loops enclose it (regions are the lines
    ending in '{', closed by lines starting with '}')."""
    stack, depths = [], []
    for line in ttgir.splitlines():
        s = line.strip()
        if s.startswith("}"):
            stack.pop()
            if s.endswith("{"):  # "} else {"
                stack.append("other")
            continue
        if "warp_group_dot " in s or "tt.dot " in s:
            depths.append(stack.count("for"))
        if s.endswith("{"):
            stack.append("for" if "scf.for" in s else "other")
    return depths


@pytest.mark.no_kernels("offline sm_90 compile in a subprocess")
def test_tma_kernel_compiles_to_tma_and_wgmma_for_sm90(tmp_path):
    """Every autotune config, in the three layouts (forward with bias + erf GELU + z, in bf16 and
    fp16; dX; dW, also split-K with its fp32 workspace),
    compiled for sm_90 without a GPU: within shared memory, no stack (no spills), the unit and K
    loops fused into one (split-K included), and the SASS
    really is TMA (UTMALDG loads, UTMASTG stores) feeding wgmma (HGMMA): a regression to cp.async
    or mma.sync would compile and run, only slower."""
    from test_bias_gelu import run_offline_compile

    rows = run_offline_compile(
        r"""
import os
os.environ.pop("BERT_FAST_AUTOTUNE", None)
from bert_fast.kernels import linear_tma as T
fn = T._linear_tma_kernel
while not isinstance(fn, triton.runtime.jit.JITFunction):
    fn = fn.fn
assert all(T.fits_shared_memory(c, 1) for c in T._configs())   # the estimate never prunes these
for cfg in T._configs():
    kw = dict(cfg.kwargs)
    bm, bn, bk, split = kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["EPILOGUE_SPLIT"]
    for layout, a_t, b_t, act, save_z, dt, split_k in (("fwd", False, True, 1, True, "bf16", 1),
                                                       ("fwd", False, True, 1, True, "fp16", 1),
                                                       ("dx", False, False, 0, False, "bf16", 1),
                                                       ("dw", True, False, 0, False, "bf16", 1),
                                                       ("dwsplit", True, False, 0, False, "bf16", 3)):
        if split_k > 1 and not T.fits_shared_memory(cfg, split_k):   # pruned, never compiled
            continue
        desc = lambda box, t=dt: f"tensordesc<{t}{list(box)}>"
        # split-K: the output descriptor is the [SPLIT_K, M, N] fp32 workspace (z_desc is the same)
        out_t = desc([1, bm, bn // split], "fp32") if split_k > 1 else desc([bm, bn // split])
        types = dict(a_desc=desc([bk, bm] if a_t else [bm, bk]), b_desc=desc([bn, bk] if b_t else [bk, bn]),
                     y_desc=out_t, z_desc=out_t, BIAS="*" + dt,
                     **{n: "i32" for n in "M N K M_BUCKET K_BUCKET KIND".split()})
        consts = dict(HAS_BIAS=layout == "fwd", ACTIVATION=act, SAVE_Z=save_z, A_T=a_t, B_T=b_t,
                      SPLIT_K=split_k, NUM_SMS=132, DOT_PRECISION="native", ACC_DTYPE=tl.float32,
                      INTERPRET=False, **kw)
        label = f"{layout}-{dt}-{bm}x{bn}x{bk}-w{cfg.num_warps}-s{cfg.num_stages}-e{split}"
        comp(fn, types, consts, 90, warps=cfg.num_warps, stages=cfg.num_stages, label=label)
        open(os.path.join(OUT_DIR, label + ".cubin"), "wb").write(LAST["cubin"])
        open(os.path.join(OUT_DIR, label + ".ttgir"), "w").write(LAST["ttgir"])
""".replace("OUT_DIR", repr(str(tmp_path)))
    )
    cubins = sorted(tmp_path.glob("*.cubin"))
    count = lambda prefix: sum(row[0].startswith(prefix) for row in rows)
    assert len(cubins) == len(rows) and count("dwsplit") >= 1
    for ttgir in sorted(tmp_path.glob("*.ttgir")):
        # one flat loop: the unit loop fused with the K loop (a nested K loop would still be right,
        # only without the next unit's loads overlapping this unit's epilogue)
        depths = _loop_depth_of_dots(ttgir.read_text())
        assert depths and all(d == 1 for d in depths), f"{ttgir.stem}: K loop not flattened {depths}"
    assert count("fwd-bf16") == count("fwd-fp16") == count("dx-") == count("dw-") >= 1
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS with (shared memory was checked)")
    for cubin in cubins:
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
        for instr in ("HGMMA", "UTMALDG", "UTMASTG"):
            assert instr in sass, f"{cubin.stem}: no {instr} in the SASS"
        assert "LDGSTS" not in sass, f"{cubin.stem}: cp.async (LDGSTS) instead of TMA"
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        assert stack == 0, f"{cubin.stem}: {stack} B of stack (register spills)"
