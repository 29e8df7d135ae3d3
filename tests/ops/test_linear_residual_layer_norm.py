"""linear_residual_layer_norm: the split-K output projection + residual + LayerNorm (inference at
small M) against the float64 oracle by the 2x rule, and the two ops everywhere else.

On the CPU the TMA GEMM runs in the interpreter (BERT_FAST_GEMM_TMA=1) with 4 "SMs", so a 16-row
GEMM of N = 64..96 has 1-2 tiles of 64 x 64 and K >= 512 gives it 2 or more K-slices."""

import pytest
import torch

from bert_fast import reference
from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import linear_residual_layer_norm as cases
from bert_fast.kernels import linear_tma
from bert_fast.ops import linear, residual_layer_norm
from bert_fast.ops.linear_residual_layer_norm import linear_residual_layer_norm
from bert_fast.testing import assert_close_2x, pick_test_device

pytestmark = pytest.mark.kernels("linear_tma", "residual_layer_norm")
DEVICE = pick_test_device()
DTYPES = [torch.float32, torch.float16] if DEVICE.type == "cpu" else [torch.float16, torch.bfloat16]


@pytest.fixture
def tma(monkeypatch, device):
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("the split-K path runs on the TMA GEMM (compute capability >= 9)")
    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "1")


def _inputs(m, n, k, device, dtype, seed=0):
    """(x, weight, bias, residual, ln_weight, ln_bias): the op's cases (bench.op_cases)."""
    return tuple(cases.sample_inputs(m, n, k, seeded_randn(seed, device, dtype)).values())


def _oracle(x, w, b, r, lw, lb, dtype):
    """The oracle in ``dtype``: LayerNorm(linear(x) + residual)."""
    cast = [t.to(dtype) for t in (x, w, b, r, lw, lb)]
    return reference.residual_layer_norm(reference.linear(*cast[:3]), cast[3], cast[4], cast[5], 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(16, 64, 520), (40, 96, 1104), (3, 64, 2048)])
def test_split_k_path_2x(device, tma, monkeypatch, m, n, k, dtype):
    """The fused path runs (split > 1, two kernels, no other GEMM) and holds the 2x rule."""
    splits = linear_tma.forward_splits(m, n, k, device)
    assert splits > 1
    ran, real = [], linear_tma.partials

    def counting(a, b, part, *rest):
        ran.append(tuple(part.shape))
        return real(a, b, part, *rest)

    monkeypatch.setattr(linear_tma, "partials", counting)
    ins = _inputs(m, n, k, device, dtype, seed=m + n + k)
    with torch.no_grad():
        y = linear_residual_layer_norm(*ins)
    assert ran == [(splits, m, n)] and y.shape == (m, n) and y.dtype == dtype
    assert_close_2x(y, _oracle(*ins, torch.float64), _oracle(*ins, dtype), name="y")


def test_leading_dims_and_no_bias(device, tma):
    x, w, _, r, lw, lb = _inputs(2 * 9, 64, 600, device, torch.float32, seed=5)
    x, r = x.view(2, 9, 600), r.view(2, 9, 64)
    with torch.no_grad():
        y = linear_residual_layer_norm(x, w, None, r, lw, lb)
    zero = torch.zeros(64, device=device)
    assert_close_2x(
        y, _oracle(x, w, zero, r, lw, lb, torch.float64), _oracle(x, w, zero, r, lw, lb, torch.float32), name="y"
    )


@pytest.mark.parametrize(
    "case", ["grad", "dropout", "env_off", "large_m"], ids=["grad", "dropout", "env-off", "tiles-fill-the-gpu"]
)
def test_two_ops_elsewhere(device, tma, monkeypatch, case):
    """Training, dropout, BERT_FAST_GEMM_LN=0 and an M whose tiles fill the GPU run linear then
    residual_layer_norm: bit for bit what calling the two ops gives."""
    monkeypatch.setattr(linear_tma, "partials", lambda *a: pytest.fail("the split-K path ran"))
    # tiles of 64 x 64 that fill half the SMs: 5 for the interpreter's 4, 70 for an H100's 132
    m = (300 if device.type == "cpu" else 4480) if case == "large_m" else 16
    x, w, b, r, lw, lb = _inputs(m, 64, 520, device, DTYPES[0], seed=7)
    p = 0.1 if case == "dropout" else 0.0
    if case == "env_off":
        monkeypatch.setenv("BERT_FAST_GEMM_LN", "0")
    if case == "grad":
        x.requires_grad_(True)
    torch.manual_seed(3)
    y = linear_residual_layer_norm(x, w, b, r, lw, lb, 1e-12, p)
    torch.manual_seed(3)
    expected = residual_layer_norm(linear(x, w, b), r, lw, lb, 1e-12, p)
    assert torch.equal(y, expected)
    if case == "grad":
        y.sum().backward()
        assert x.grad is not None


def test_model_runs_it_for_its_output_projections(device, tma, monkeypatch):
    """A BertModel at inference takes the op for the FFN down-projection (K = 512: 2 slices here)
    and holds the 2x rule against transformers in float64, measured against its own output with
    the op off (BERT_FAST_GEMM_LN=0: the GEMM, then residual_layer_norm)."""
    import transformers

    import bert_fast
    from bert_fast.testing import tiny_bert_config

    torch.manual_seed(0)
    hf = transformers.BertModel(tiny_bert_config(inter=512), add_pooling_layer=False).eval().to(device)
    ids = torch.randint(1, 101, (1, 16), device=device)
    with torch.no_grad():
        ref64 = hf.double()(ids).last_hidden_state
        model = bert_fast.optimize(hf.to(DTYPES[0]))  # fp32 in the interpreter; fp16 on a GPU (TMA)
        monkeypatch.setenv("BERT_FAST_GEMM_LN", "0")
        unfused = model(ids).last_hidden_state
        monkeypatch.delenv("BERT_FAST_GEMM_LN")
        ran, real = [], linear_tma.partials
        monkeypatch.setattr(
            linear_tma, "partials", lambda a, b, part, *rest: ran.append(part.shape[0]) or real(a, b, part, *rest)
        )
        fused = model(ids).last_hidden_state
    assert ran == [2, 2]  # each layer's down-projection; the attention output's K = 64 is too short to split
    assert_close_2x(fused, ref64, unfused, name="last_hidden_state")


@pytest.mark.no_kernels("offline sm_90 / sm_80 compile in a subprocess")
def test_split_k_kernels_compile_without_spills(tmp_path):
    """Compiled offline, within shared memory (run_offline_compile) and without stack: the forward
    GEMM writing fp32 K-slice partials (x row-major, W stored [N, K]) at both fixed tiles and 3 and 5
    slices for sm_90, as TMA loads and stores feeding wgmma; the slice-summing LayerNorm for
    BERT-base and -large rows (N = 768, 1024), 3 and 8 slices, for sm_90 and sm_80."""
    import re
    import subprocess

    from test_bias_gelu import run_offline_compile
    from test_linear_tma import _cuobjdump

    rows = run_offline_compile(
        r"""
import os
os.environ["BERT_FAST_AUTOTUNE"] = "0"
from bert_fast.kernels import linear_tma as T, residual_layer_norm as K
fn = T._linear_tma_kernel
while not isinstance(fn, triton.runtime.jit.JITFunction):
    fn = fn.fn
for cfg in T._configs():
    kw = dict(cfg.kwargs)
    bm, bn, bk, e = kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["EPILOGUE_SPLIT"]
    for split_k in (3, 5):
        box = f"tensordesc<fp32[1, {bm}, {bn // e}]>"
        types = dict(a_desc=f"tensordesc<bf16[{bm}, {bk}]>", b_desc=f"tensordesc<bf16[{bn}, {bk}]>", y_desc=box,
                     z_desc=box, BIAS="*fp32", **{n: "i32" for n in "M N K M_BUCKET K_BUCKET KIND".split()})
        consts = dict(HAS_BIAS=False, ACTIVATION=0, SAVE_Z=False, A_T=False, B_T=True, SPLIT_K=split_k,
                      NUM_SMS=132, DOT_PRECISION="native", ACC_DTYPE=tl.float32, INTERPRET=False, **kw)
        label = f"gemm-split{split_k}-{bm}x{bn}x{bk}-w{cfg.num_warps}-s{cfg.num_stages}"
        comp(fn, types, consts, 90, warps=cfg.num_warps, stages=cfg.num_stages, label=label)
        open(os.path.join(OUT_DIR, label + ".cubin"), "wb").write(LAST["cubin"])
for cc in (90, 80):
    for n in (768, 1024):
        bm, bn, warps = K._config(n)
        for slices in (3, 8):
            p = "*bf16"
            types = dict(P="*fp32", XB=p, R=p, W=p, B=p, Y=p, MEAN="*fp32", RSTD="*fp32", M="i32", N="i32",
                         stride_rm="i32", stride_ym="i32", eps="fp32")
            consts = dict(SLICES=slices, COMPUTE=tl.float32, BLOCK_M=bm, BLOCK_N=bn)
            label = f"ln-sm{cc}-n{n}-s{slices}"
            comp(K._partials_residual_layer_norm_kernel, types, consts, cc, warps=warps, label=label)
            open(os.path.join(OUT_DIR, label + ".cubin"), "wb").write(LAST["cubin"])
""".replace("OUT_DIR", repr(str(tmp_path)))
    )
    assert len(rows) == 4 + 8
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS with (shared memory was checked)")
    for cubin in sorted(tmp_path.glob("*.cubin")):
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, f"{cubin.stem}: register spills"
        if cubin.stem.startswith("gemm"):
            assert all(i in sass for i in ("HGMMA", "UTMALDG", "UTMASTG")), f"{cubin.stem}: not TMA + wgmma"
