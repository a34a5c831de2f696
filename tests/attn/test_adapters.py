"""The GPU backends' argument adapters, checked on the CPU against fake kernels.

Each fake has the exact signature of one library release (read from its source) and implements that
library's documented semantics with the reference; it raises on arguments the real kernel would
misread. So these tests catch a wrong keyword, a wrong positional order (FA4's 4th parameter is ``qv``),
a wrong window translation (FA4 spells "unbounded" as None) or a lost GQA flag without a GPU. The kernels
themselves are compared with the reference on the device in tests/attn/test_attn_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.attn.test_attn import make_inputs
from varpack.attn import BACKENDS, CallSpec, reference_varlen_attention
from varpack.attn._flash_common import parameters
from varpack.attn.flash_attn4 import fa4_window

CALLS: list[dict] = []


def _ref(q, k, v, cu_q, cu_k, *, causal, window, scale, softcap=0.0):
    return reference_varlen_attention(
        q, k, v, cu_q, cu_k, causal=causal, window_size=window, softmax_scale=scale, softcap=softcap
    )


# torch 2.11: causal is window_size=(-1, 0); GQA accepted without a flag.
def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    CALLS.append(dict(scale=scale, window_size=window_size))
    return _ref(query, key, value, cu_seq_q, cu_seq_k, causal=False, window=window_size, scale=scale)


# torch 2.13: adds enable_gqa (required when Hkv < H).
def varlen_attn_2_13(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise RuntimeError("number of heads in key/value must equal query heads unless enable_gqa=True")
    CALLS.append(dict(scale=scale, window_size=window_size, enable_gqa=enable_gqa))
    return _ref(query, key, value, cu_seq_q, cu_seq_k, causal=False, window=window_size, scale=scale)


# an older form: is_causal, no scale, no window, no GQA
def varlen_attn_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    if query.shape[1] != key.shape[1]:
        raise RuntimeError("no GQA in this release")
    CALLS.append(dict(is_causal=is_causal))
    return _ref(query, key, value, cu_seq_q, cu_seq_k, causal=is_causal, window=(-1, -1), scale=None)


# FA2 (flash_attn/flash_attn_interface.py, 2.6+)
def fa2_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    assert dropout_p == 0.0
    CALLS.append(dict(causal=causal, window_size=window_size, softcap=softcap))
    return _ref(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        causal=causal,
        window=window_size,
        scale=softmax_scale,
        softcap=softcap,
    )


# FA2 before 2.6: no softcap
def fa2_varlen_2_5(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False,
):  # fmt: skip
    return _ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, window=window_size, scale=softmax_scale)


# FA3 (hopper/flash_attn_interface.py); older releases return (out, lse)
def fa3_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
    softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
    deterministic=False, sm_margin=0, return_attn_probs=False,
):  # fmt: skip
    assert seqused_q is None and seqused_k is None and qv is None
    out = _ref(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        causal=causal,
        window=window_size,
        scale=softmax_scale,
        softcap=softcap,
    )
    return out, torch.zeros(q.shape[1], q.shape[0])


# FA4 4.0.0b36 (flash_attn/cute/interface.py): qv is the 4th positional parameter; None = unbounded
def fa4_varlen(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
    softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
    num_splits=1, pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
    block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
    scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
    gather_bwd_recompute_p=False, gather_bwd_token_chunk=None,
):  # fmt: skip
    assert qv is None and cu_seqlens_q is not None and cu_seqlens_k is not None
    left, right = window_size
    # FA4's _resolve_causal_local_window
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    local = False
    if left is not None or right is not None:
        if left is None and right == 0:
            causal, right = True, None
        else:
            causal, local = False, True
    if local:  # a negative int here is a real (empty) window bound in FA4, not "unbounded"
        assert (left is None or left >= 0) and (right is None or right >= 0), window_size
    window = (-1 if left is None else left, -1 if right is None else right)
    CALLS.append(dict(causal=causal, window_size=window_size, local=local))
    out = _ref(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        causal=causal,
        window=window,
        scale=softmax_scale,
        softcap=softcap,
    )
    return out, torch.zeros(q.shape[1], q.shape[0])


CASES = [
    pytest.param([5, 1, 7], None, True, (-1, -1), 4, 2, id="causal-gqa"),
    pytest.param([5, 1, 7], None, False, (-1, -1), 4, 4, id="noncausal"),
    pytest.param([9, 3, 6], None, True, (2, 0), 4, 1, id="causal-window-mqa"),
    pytest.param([9, 3, 6], None, False, (2, 1), 2, 2, id="noncausal-window"),
    pytest.param([9, 3, 6], None, False, (-1, 2), 2, 2, id="noncausal-right-window"),
    pytest.param([2, 5, 3], [5, 2, 3], True, (-1, 0), 4, 2, id="q!=k"),
    pytest.param([1], None, True, (-1, 0), 4, 2, id="T=1"),
]

FAKES = [
    ("torch_varlen", varlen_attn_2_11),
    ("torch_varlen", varlen_attn_2_13),
    ("torch_varlen", varlen_attn_old),
    ("flash_attn", fa2_varlen),
    ("flash_attn_3", fa3_varlen),
    ("flash_attn_4", fa4_varlen),
]


def _install(monkeypatch, name, fake):
    backend = BACKENDS[name]
    monkeypatch.setattr(backend, "_fn", fake, raising=False)
    monkeypatch.setattr(backend, "_params", parameters(fake), raising=False)
    return backend


@pytest.mark.parametrize("name,fake", FAKES, ids=[f.__name__ for _, f in FAKES])
@pytest.mark.parametrize("lens_q,lens_k,causal,window,h,hkv", CASES)
def test_adapter_passes_the_right_arguments(monkeypatch, name, fake, lens_q, lens_k, causal, window, h, hkv):
    backend = _install(monkeypatch, name, fake)
    q, k, v, cu_q, cu_k = make_inputs(lens_q, lens_k, h=h, hkv=hkv, dtype=torch.float64)
    lens_k = lens_q if lens_k is None else lens_k
    # what varlen_attention hands a backend: flash-attn normalization (causal forces right = 0)
    left, right = window
    if causal:
        right = 0
    elif right == 0:
        causal = True
    spec = CallSpec(q.device, torch.bfloat16, q.shape[-1], h, hkv, causal=causal, window_size=(left, right))
    ok, reason = backend._extra_supports(spec)
    if not ok:
        assert fake is varlen_attn_old and ("window" in reason), reason
        return
    scale = 0.37 if fake is not varlen_attn_old else 0.29
    CALLS.clear()
    out = backend.forward(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
        causal=causal, window_size=(left, right), softmax_scale=scale, softcap=0.0,
    )  # fmt: skip
    want = reference_varlen_attention(
        q, k, v, cu_q, cu_k, causal=causal, window_size=(left, right), softmax_scale=scale
    )
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert len(CALLS) <= 1


@pytest.mark.parametrize(
    "name,fake", [("flash_attn", fa2_varlen), ("flash_attn_3", fa3_varlen), ("flash_attn_4", fa4_varlen)]
)
def test_flash_adapters_pass_softcap(monkeypatch, name, fake):
    backend = _install(monkeypatch, name, fake)
    q, k, v, cu, _ = make_inputs([6, 4], dtype=torch.float64)
    out = backend.forward(
        q, k, v, cu, cu, 6, 6, causal=True, window_size=(-1, 0), softmax_scale=0.25, softcap=2.0
    )
    want = reference_varlen_attention(q, k, v, cu, cu, softmax_scale=0.25, softcap=2.0)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_softcap_refused_where_the_library_lacks_it(monkeypatch):
    spec = CallSpec(torch.device("cpu"), torch.bfloat16, 64, 4, 4, causal=True, softcap=5.0)
    backend = _install(monkeypatch, "flash_attn", fa2_varlen_2_5)
    ok, reason = backend._extra_supports(spec)
    assert not ok and "softcap" in reason
    assert not BACKENDS["torch_varlen"].capabilities.softcap


def test_torch_varlen_gqa_flag_and_causal_window(monkeypatch):
    backend = _install(monkeypatch, "torch_varlen", varlen_attn_2_13)
    q, k, v, cu, _ = make_inputs([5, 3], h=4, hkv=2, dtype=torch.float64)
    CALLS.clear()
    backend.forward(q, k, v, cu, cu, 5, 5, causal=True, window_size=(-1, 0), softmax_scale=0.3, softcap=0.0)
    assert CALLS == [dict(scale=0.3, window_size=(-1, 0), enable_gqa=True)]


def test_fa4_window_translation():
    assert fa4_window(True, (-1, 0), 7, 9) == (None, None)  # causal: FA4 applies it itself
    assert fa4_window(False, (-1, -1), 7, 9) == (None, None)
    assert fa4_window(True, (3, 0), 7, 9) == (3, 0)
    assert fa4_window(False, (3, -1), 7, 9) == (3, 9)  # unbounded side: >= any segment length
    assert fa4_window(False, (-1, 2), 7, 9) == (9, 2)
