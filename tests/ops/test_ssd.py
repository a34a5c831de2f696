"""The SSD (Mamba-2) scan with sample boundaries: the chunked op == the token-by-token recurrence run on each
sample alone (fp64 and fp32, forward, final states and every gradient), for odd lengths, 1-token and empty
samples and chunks that straddle samples; the per-sample reference agrees with transformers' own PyTorch
``mamba2_chunk_scan`` (an implementation independent of varpack's); the negative control (no boundaries)
fails; bad input is refused by name."""

from __future__ import annotations

import pytest
import torch

from varpack.ops.ssd import (
    chunk_ssd_scan,
    mamba_ssm_status,
    naive_recurrent_ssd_scan,
    prepare_ssd_layout,
    resolve_ssd_backend,
    ssd_scan,
)

LENGTHS = [5, 1, 30, 17, 1, 2]  # odd lengths, 1-token samples; with chunk 8 most chunks straddle a boundary
H, P, G, S = 4, 3, 2, 5


def _problem(lengths=LENGTHS, dtype=torch.float64, seed=0, rows=1):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    inputs = {
        "x": rnd(rows, T, H, P),
        "dt": rnd(rows, T, H),
        "A": -(torch.rand(H, generator=gen, dtype=dtype) + 0.5),
        "B": rnd(rows, T, G, S),
        "C": rnd(rows, T, G, S),
        "D": rnd(H),
        "dt_bias": rnd(H),
    }
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return inputs, cu


def _per_sample(inputs, cu, **kw):
    """The truth: the naive recurrence on each sample alone (its own row), concatenated."""
    ys, finals = [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        part = {k: (v[:, a:b] if v.dim() > 1 else v) for k, v in inputs.items()}
        y, f = naive_recurrent_ssd_scan(**part, dt_softplus=True, return_final_states=True, **kw)
        ys.append(y)
        finals.append(f)
    return torch.cat(ys, dim=1), torch.cat(finals)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
def test_chunk_equals_naive_per_sample_fp64(chunk_size):
    inputs, cu = _problem()
    ref_y, ref_f = _per_sample(inputs, cu)
    y, f = chunk_ssd_scan(
        **inputs, chunk_size=chunk_size, dt_softplus=True, cu_seqlens=cu, return_final_states=True
    )
    assert y.dtype == torch.float64 and f.shape == (len(LENGTHS), H, P, S)
    assert _rel(y, ref_y) < 1e-12 and _rel(f, ref_f) < 1e-12
    # the naive op on the packed row, with boundaries, is the same recurrence
    y_naive, f_naive = naive_recurrent_ssd_scan(
        **inputs, dt_softplus=True, cu_seqlens=cu, return_final_states=True
    )
    assert _rel(y_naive, ref_y) < 1e-14 and _rel(f_naive, ref_f) < 1e-14


def test_seq_idx_and_a_shared_layout_equal_cu_seqlens():
    inputs, cu = _problem()
    T = int(cu[-1])
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS), dtype=torch.int32), cu.diff())[None]
    ref, _ = chunk_ssd_scan(**inputs, chunk_size=8, dt_softplus=True, cu_seqlens=cu)
    by_idx, _ = chunk_ssd_scan(**inputs, chunk_size=8, dt_softplus=True, seq_idx=seq_idx)
    layout = prepare_ssd_layout(T, 8, seq_idx=seq_idx)
    by_layout, _ = chunk_ssd_scan(**inputs, chunk_size=8, dt_softplus=True, layout=layout)
    assert torch.equal(by_idx, ref) and torch.equal(by_layout, ref)


def test_empty_samples_and_one_sample_and_rows():
    inputs, cu = _problem([3, 0, 9, 0])
    ref_y, ref_f = _per_sample(inputs, cu)
    y, f = chunk_ssd_scan(**inputs, chunk_size=4, dt_softplus=True, cu_seqlens=cu, return_final_states=True)
    assert _rel(y, ref_y) < 1e-12 and _rel(f, ref_f) < 1e-12
    assert not f[1].any() and not f[3].any()  # an empty sample's state is its (zero) initial state
    # no boundaries: every row is one sample
    rows, _ = _problem([11], rows=3)
    y_rows, f_rows = chunk_ssd_scan(**rows, chunk_size=4, dt_softplus=True, return_final_states=True)
    for r in range(3):
        part = {k: (v[r : r + 1] if v.dim() > 1 else v) for k, v in rows.items()}
        y_r, f_r = naive_recurrent_ssd_scan(**part, dt_softplus=True, return_final_states=True)
        assert _rel(y_rows[r : r + 1], y_r) < 1e-12 and _rel(f_rows[r : r + 1], f_r) < 1e-12


def test_dt_limit_and_no_skip():
    inputs, cu = _problem()
    D = inputs.pop("D")
    limit = (0.3, 1.2)  # clamps both ends of softplus(dt + dt_bias) for standard-normal dt
    ref, _ = _per_sample(inputs, cu, dt_limit=limit)
    y, _ = chunk_ssd_scan(**inputs, chunk_size=8, dt_softplus=True, dt_limit=limit, cu_seqlens=cu)
    assert _rel(y, ref) < 1e-12
    unclamped, _ = chunk_ssd_scan(**inputs, chunk_size=8, dt_softplus=True, cu_seqlens=cu)
    assert _rel(unclamped, ref) > 1e-3  # the limit changed something
    with_skip, _ = chunk_ssd_scan(
        **inputs, D=D, chunk_size=8, dt_softplus=True, dt_limit=limit, cu_seqlens=cu
    )
    x = inputs["x"]
    assert _rel(with_skip - y, D[:, None] * x) < 1e-12


def test_gradients_chunk_equal_naive_per_sample():
    inputs, cu = _problem()
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    dy = torch.randn(1, int(cu[-1]), H, P, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    dfinal = torch.randn(
        len(LENGTHS), H, P, S, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    ref_y, ref_f = _per_sample(leaves, cu)
    ref = torch.autograd.grad((ref_y * dy).sum() + (ref_f * dfinal).sum(), list(leaves.values()))
    y, f = chunk_ssd_scan(**leaves, chunk_size=8, dt_softplus=True, cu_seqlens=cu, return_final_states=True)
    got = torch.autograd.grad((y * dy).sum() + (f * dfinal).sum(), list(leaves.values()))
    for name, a, b in zip(leaves, got, ref):
        assert _rel(a, b) < 1e-10, name


def test_fp32_matches_transformers_reference_per_sample():
    """transformers' own PyTorch chunk scan (fp32 inside) on each sample alone == varpack's packed chunk
    scan."""
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    inputs, cu = _problem(dtype=torch.float32)
    parts = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        parts.append(
            mamba2_chunk_scan(
                inputs["x"][:, a:b], inputs["dt"][:, a:b], inputs["A"], inputs["B"][:, a:b],
                inputs["C"][:, a:b],
                chunk_size=16, D=inputs["D"], dt_bias=inputs["dt_bias"], dt_softplus=True,
            )
        )  # fmt: skip
    theirs = torch.cat(parts, dim=1)
    ours, _ = chunk_ssd_scan(**inputs, chunk_size=8, dt_softplus=True, cu_seqlens=cu)
    assert ours.dtype == theirs.dtype == torch.float32
    assert _rel(ours, theirs) < 1e-5


def test_negative_control_without_boundaries_fails():
    inputs, cu = _problem()
    ref, _ = _per_sample(inputs, cu)
    leaked, _ = chunk_ssd_scan(**inputs, chunk_size=8, dt_softplus=True)  # one sequence over the whole row
    assert _rel(leaked, ref) > 1e-2
    # and only the tokens of the first sample agree
    first = int(cu[1])
    assert _rel(leaked[:, :first], ref[:, :first]) < 1e-12


def test_dispatch_backends_on_cpu():
    inputs, cu = _problem(dtype=torch.float32)
    assert resolve_ssd_backend("auto", "cpu") == "chunk"
    chunk, _ = ssd_scan(**inputs, chunk_size=8, dt_softplus=True, cu_seqlens=cu)
    naive, _ = ssd_scan(**inputs, chunk_size=8, dt_softplus=True, cu_seqlens=cu, backend="naive")
    assert _rel(chunk, naive) < 1e-5
    (fwd, bwd) = mamba_ssm_status("cpu")
    assert not fwd[0] and "CUDA" in fwd[1]
    with pytest.raises(RuntimeError, match="'mamba_ssm' cannot run on cpu"):
        ssd_scan(**inputs, cu_seqlens=cu, backend="mamba_ssm")
    with pytest.raises(ValueError, match="unknown SSD backend 'fast'"):
        ssd_scan(**inputs, cu_seqlens=cu, backend="fast")
    seq_idx = torch.zeros(1, int(cu[-1]), dtype=torch.int32)
    with pytest.raises(ValueError, match="naive SSD backend takes cu_seqlens"):
        ssd_scan(**inputs, seq_idx=seq_idx, backend="naive")


def test_bad_input_refused_by_name():
    inputs, cu = _problem()
    T = int(cu[-1])
    bad_dt = {**inputs, "dt": inputs["dt"][..., :2]}
    with pytest.raises(ValueError, match=r"dt must be \[B=1, T=56, H=4\]"):
        chunk_ssd_scan(**bad_dt, cu_seqlens=cu)
    with pytest.raises(ValueError, match="multiple of the groups G=3"):
        three = {k: inputs[k].repeat(1, 1, 2, 1)[:, :, :3] for k in ("B", "C")}
        chunk_ssd_scan(**{**inputs, **three})
    with pytest.raises(ValueError, match="end at the token count"):
        chunk_ssd_scan(**inputs, cu_seqlens=torch.tensor([0, 5, T - 1]))
    with pytest.raises(TypeError, match="cu_seqlens"):
        chunk_ssd_scan(**inputs, cu_seqlens=torch.tensor([0.0, float(T)]))
    with pytest.raises(TypeError, match="seq_idx must be an integer tensor"):
        chunk_ssd_scan(**inputs, seq_idx=torch.zeros(1, T))
    with pytest.raises(ValueError, match="dt_limit must satisfy"):
        chunk_ssd_scan(**inputs, dt_limit=(1.0, 0.5))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunk_ssd_scan(**inputs, chunk_size=0)
    with pytest.raises(ValueError, match="layout is for T=56, B=1, chunk_size=8"):
        chunk_ssd_scan(**inputs, chunk_size=16, layout=prepare_ssd_layout(T, 8, cu_seqlens=cu))
    with pytest.raises(ValueError, match="return_final_states needs cu_seqlens"):
        chunk_ssd_scan(**inputs, seq_idx=torch.zeros(1, T, dtype=torch.int64), return_final_states=True)
    rows, _ = _problem([4], rows=2)
    with pytest.raises(ValueError, match="batch dimension must be 1"):
        chunk_ssd_scan(**rows, cu_seqlens=torch.tensor([0, 2, 4]))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["chunk", "auto"])
def test_gpu_scan_matches_the_fp64_truth(backend):
    """On CUDA: the chunked path, and ``auto`` (mamba_ssm where installed and probed, else chunk), against the
    per-sample fp64 recurrence, forward and gradients (fp32 inputs; mamba_ssm's Triton dots may run in TF32)."""
    inputs, cu = _problem(dtype=torch.float32)
    ref_in = {k: v.double().requires_grad_() for k, v in inputs.items()}
    dy = torch.randn(1, int(cu[-1]), H, P, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref_y, _ = _per_sample(ref_in, cu)
    ref_g = torch.autograd.grad((ref_y * dy).sum(), list(ref_in.values()))
    dev = {k: v.cuda().requires_grad_() for k, v in inputs.items()}
    name = resolve_ssd_backend(backend, "cuda")
    y, _ = ssd_scan(**dev, chunk_size=16, dt_softplus=True, cu_seqlens=cu, backend=backend)
    got = torch.autograd.grad((y * dy.cuda().float()).sum(), list(dev.values()))
    tol = 1e-5 if name == "chunk" else 5e-3
    assert _rel(y.double().cpu(), ref_y) < tol, name
    for key, a, b in zip(dev, got, ref_g):
        assert _rel(a.double().cpu(), b) < 10 * tol, (name, key)
    print(f"ssd auto on cuda: {resolve_ssd_backend('auto', 'cuda')} ({mamba_ssm_status('cuda')})")
