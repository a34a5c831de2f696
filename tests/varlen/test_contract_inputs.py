"""One input contract for every entry point that reads boundaries, and for the collator's token fields.

* ``max_seqlen`` / ``max_length_q/k``: a host integer of any integral type (Python int, NumPy integer such as
  ``np.max(lengths)``, one-element CPU integer tensor) is a Python int; a device tensor (a host sync per
  layer), a float or a bool is refused naming the key -- the same in the packing guard, ``varlen_attention``
  and ``resolve_backend``.
* ``cu_seqlens`` / ``cu_seq_lens_q/k``: a list / tuple / NumPy array of integers is converted once to a CPU
  int32 tensor (guard, attention, gated-delta layers and ops, short conv); non-integers are refused naming the
  key (a ``PackingGuardError`` in the guard).
* ``PaddingFreeCollator``: every token-aligned field must be a 1-D sequence; a scalar, ``None``, a string or a
  nested value raises a ValueError naming the sample (sample_id and batch index) and the field.

The right values: an accepted alternative input must give exactly (``torch.equal``) the result of the
canonical input (int / int32 tensor), and a negative control shows the converted boundaries are really used.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from varpack.attn import resolve_backend, varlen_attention
from varpack.collate import PaddingFreeCollator
from varpack.integrations.transformers import PackingGuardError, enable_varpack
from varpack.loss import causal_lm_loss
from varpack.models import load_model
from varpack.models.gated_delta import tiny_model
from varpack.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    prepare_chunk_layout,
)
from varpack.ops.short_conv import seq_idx_for_conv, short_conv
from varpack.varlen import (
    max_seqlen_from_cu_seqlens,
    normalize_cu_seqlens,
    normalize_max_seqlen,
    seq_idx_from_cu_seqlens,
    validate_cu_seqlens,
)

VOCAB = 512
LENGTHS = (5, 1, 7, 3)
META = "meta"  # a non-CPU device available everywhere: stands for a CUDA tensor (reading it is a host sync)


def make_samples(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[: max(1, n // 3)] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "sample_id": i})
    return out


# ---------------------------------------------------------------------------------------------------------
# the shared helpers
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        3,
        np.int64(3),
        np.int32(3),
        np.uint8(3),
        np.array(3),
        np.array([3]),
        torch.tensor(3),
        torch.tensor([3]),
    ],
    ids=[
        "int",
        "np.int64",
        "np.int32",
        "np.uint8",
        "0-d array",
        "1-elem array",
        "0-d tensor",
        "1-elem tensor",
    ],
)
def test_max_seqlen_host_integers_become_python_ints(value):
    out = normalize_max_seqlen(value, "max_length_q")
    assert type(out) is int and out == 3


@pytest.mark.parametrize(
    "value, exc, message",
    [
        (torch.tensor(3, device=META), TypeError, r"max_length_q must be a Python int .* tensor on meta"),
        (3.0, TypeError, r"max_length_q must be an integer .* float 3.0"),
        (np.float64(3.0), TypeError, r"max_length_q must be an integer"),
        (True, TypeError, r"max_length_q must be an integer, got bool True"),
        (np.bool_(True), TypeError, r"max_length_q must be an integer, got bool"),
        (
            torch.tensor(3.0),
            TypeError,
            r"max_length_q must be an integer, got a tensor of dtype torch.float32",
        ),
        (torch.tensor([3, 4]), TypeError, r"max_length_q must be one integer, got a tensor of shape \(2,\)"),
        (np.array([3, 4]), TypeError, r"max_length_q must be one integer"),
        (None, TypeError, r"max_length_q must be an integer .* NoneType"),
        ("3", TypeError, r"max_length_q must be an integer .* str"),
        (-1, ValueError, r"max_length_q must be >= 0 .* got -1"),
    ],
)
def test_max_seqlen_refusals_name_the_key(value, exc, message):
    with pytest.raises(exc, match=message):
        normalize_max_seqlen(value, "max_length_q")


def test_cu_seqlens_conversion():
    canonical = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    for value in ([0, 3, 4, 7], (0, 3, 4, 7), np.array([0, 3, 4, 7]), [np.int64(0), 3, 4, np.int32(7)]):
        out = normalize_cu_seqlens(value, "cu_seq_lens_q")
        assert out.dtype == torch.int32 and out.device.type == "cpu" and torch.equal(out, canonical)
    # a tensor is returned as is (identity keeps the per-batch caches); other integer dtypes become int32
    assert normalize_cu_seqlens(canonical) is canonical
    wide = canonical.long()
    assert normalize_cu_seqlens(wide) is wide
    assert torch.equal(normalize_cu_seqlens(canonical.to(torch.int16)), canonical)


@pytest.mark.parametrize(
    "value, exc, message",
    [
        ([0, 2.5, 7], TypeError, r"cu_seq_lens_q must hold integers, got a list of dtype float64"),
        ([0.0, 3.0, 7.0], TypeError, r"cu_seq_lens_q must hold integers"),  # integral floats too
        ([False, True], TypeError, r"cu_seq_lens_q must hold integers, got a list of dtype bool"),
        (torch.tensor([0.0, 7.0]), TypeError, r"cu_seq_lens_q must be an int32/int64 tensor .*torch.float32"),
        (torch.tensor([False, True]), TypeError, r"cu_seq_lens_q must be an int32/int64 tensor .*torch.bool"),
        (["0", "7"], TypeError, r"cu_seq_lens_q must hold integers"),
        ([0, [3, 4]], TypeError, r"cu_seq_lens_q must be a 1-D sequence of integers"),
        (7, TypeError, r"cu_seq_lens_q must be an int32 tensor \[N\+1\] .* got int 7"),
        (None, TypeError, r"cu_seq_lens_q must be an int32 tensor"),
        ("0,7", TypeError, r"cu_seq_lens_q must be an int32 tensor"),
        ([[0, 3, 7]], ValueError, r"cu_seq_lens_q must be 1-D \[N\+1\] .* got shape \(1, 3\)"),
        ([0], ValueError, r"at least 2 entries .* got shape \(1,\)"),
        ([], ValueError, r"at least 2 entries .* got shape \(0,\)"),
        ([0, 2**40], ValueError, r"cu_seq_lens_q has values outside int32"),
    ],
)
def test_cu_seqlens_refusals_name_the_key(value, exc, message):
    with pytest.raises(exc, match=message):
        normalize_cu_seqlens(value, "cu_seq_lens_q")


def test_boundary_readers_share_the_contract():
    assert max_seqlen_from_cu_seqlens([0, 3, 4, 7]) == 3
    assert seq_idx_from_cu_seqlens((0, 3, 4, 7), 7).tolist() == [[0, 0, 0, 1, 2, 2, 2]]
    validate_cu_seqlens(torch.tensor([0, 3, 4, 7], dtype=torch.int32), 7, max_seqlen=np.int64(3))
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        max_seqlen_from_cu_seqlens([0, 3.5, 7])
    with pytest.raises(TypeError, match=r"max_seqlen must be a Python int .* on meta"):
        validate_cu_seqlens(
            torch.tensor([0, 3, 4, 7], dtype=torch.int32), 7, max_seqlen=torch.tensor(3, device=META)
        )


# ---------------------------------------------------------------------------------------------------------
# the packing guard, through a real forward of tiny models
# ---------------------------------------------------------------------------------------------------------
def _forward_loss(model, batch):
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "sample_ids")}
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    loss = causal_lm_loss(logits, batch["labels"], seq_idx=batch["seq_idx"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


@pytest.fixture(scope="module")
def models():
    qwen3 = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    qwen35 = enable_varpack(tiny_model("tiny-qwen3.5", seed=1, vocab_size=VOCAB), linear_backend="chunk")
    return {"tiny-qwen3": qwen3, "tiny-qwen3.5": qwen35}


def _host_variants(batch):
    """The collator's batch as a custom collator might give it: NumPy integers and Python lists."""
    lengths = np.diff(batch["cu_seq_lens_q"].numpy())
    out = dict(batch)
    out["max_length_q"] = np.max(lengths)  # np.int64
    out["max_length_k"] = np.max(lengths)
    cu = [int(x) for x in batch["cu_seq_lens_q"]]
    out["cu_seq_lens_q"] = cu
    out["cu_seq_lens_k"] = list(cu)  # a different list object: converted separately, same values
    out.pop("varlen_meta")  # a custom collator gives only transformers' kwargs
    return out


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_guard_accepts_numpy_max_length_and_list_cu_seqlens_exactly(models, name):
    model = models[name]
    batch = PaddingFreeCollator()([make_samples()])
    ref_logits, ref_loss, ref_grads = _forward_loss(model, batch)

    variant = _host_variants(batch)
    assert isinstance(variant["max_length_q"], np.integer) and isinstance(variant["cu_seq_lens_q"], list)
    logits, loss, grads = _forward_loss(model, variant)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)

    # a NumPy array of offsets and 0-d CPU tensor max lengths: the same
    variant = dict(batch)
    variant.pop("varlen_meta")
    variant["cu_seq_lens_q"] = variant["cu_seq_lens_k"] = batch["cu_seq_lens_q"].numpy().astype(np.int64)
    variant["max_length_q"] = variant["max_length_k"] = torch.tensor(batch["max_length_q"])
    assert torch.equal(_forward_loss(model, variant)[1], ref_loss)

    # negative control: the list is really read -- one segment over the row changes the loss
    t = batch["input_ids"].shape[1]
    wrong = dict(batch, cu_seq_lens_q=[0, t], cu_seq_lens_k=[0, t], max_length_q=np.int64(t))
    wrong.pop("varlen_meta")
    wrong["max_length_k"] = np.int64(t)
    assert not torch.allclose(_forward_loss(model, wrong)[1], ref_loss)


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "max_length_q",
            torch.tensor(7, device=META),
            r"max_length_q must be a Python int .* tensor on meta",
        ),
        ("max_length_k", 7.0, r"max_length_k must be an integer .* float 7.0"),
        ("max_length_q", True, r"max_length_q must be an integer, got bool"),
        ("cu_seq_lens_q", [0, 5, 6.5, 13, 16], r"cu_seq_lens_q must hold integers"),
        ("cu_seq_lens_k", "0,16", r"cu_seq_lens_k must be an int32 tensor"),
        ("cu_seq_lens_q", [[0, 5, 6, 13, 16]], r"cu_seq_lens_q must be 1-D \[N\+1\]"),
    ],
)
def test_guard_refusals_are_packing_guard_errors_naming_the_key(models, key, value, message):
    batch = PaddingFreeCollator()([make_samples()])
    batch[key] = value
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "sample_ids")}
    with pytest.raises(PackingGuardError, match=message):
        models["tiny-qwen3"](**inputs)


def test_guard_checks_converted_list_values(models):
    batch = PaddingFreeCollator()([make_samples()])
    t = batch["input_ids"].shape[1]
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = [0, 4, t - 1]
    batch.pop("varlen_meta")  # replaced boundaries: the collator's meta no longer describes them
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "sample_ids")}
    with pytest.raises(PackingGuardError, match=f"cu_seq_lens_q=.*T={t}"):
        models["tiny-qwen3"](**inputs)


# ---------------------------------------------------------------------------------------------------------
# varlen_attention and resolve_backend
# ---------------------------------------------------------------------------------------------------------
def _qkv(lengths=(3, 1, 4), heads=2, dim=8):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q, k, v = (torch.randn(t, heads, dim, generator=g) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_varlen_attention_host_integers_and_list_offsets_exactly(backend):
    q, k, v, cu, longest = _qkv()
    ref = varlen_attention(q, k, v, cu, cu, longest, longest, backend=backend)
    lst = cu.tolist()
    for cu_q, cu_k, mq, mk in [
        (lst, lst, np.int64(longest), np.int64(longest)),
        (np.asarray(lst), tuple(lst), torch.tensor(longest), np.array([longest])),
        (cu.long(), cu, np.int32(longest), longest),
    ]:
        out = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend=backend)
        assert torch.equal(out, ref)
    # negative control: the list is read (one segment over the stream gives another output)
    whole = [0, q.shape[0]]
    assert not torch.allclose(
        varlen_attention(q, k, v, whole, whole, q.shape[0], q.shape[0], backend=backend), ref
    )


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (
            {"max_seqlen_q": torch.tensor(4, device=META)},
            TypeError,
            r"max_seqlen_q must be a Python int .* meta",
        ),
        ({"max_seqlen_k": 4.0}, TypeError, r"max_seqlen_k must be an integer .* float"),
        ({"max_seqlen_q": np.float32(4)}, TypeError, r"max_seqlen_q must be an integer"),
        ({"max_seqlen_q": False}, TypeError, r"max_seqlen_q must be an integer, got bool"),
        ({"cu_seqlens_q": [0, 3.0, 4, 8]}, TypeError, r"cu_seqlens_q must hold integers"),
        ({"cu_seqlens_k": None}, TypeError, r"cu_seqlens_k must be an int32 tensor"),
    ],
)
def test_varlen_attention_refusals_name_the_argument(kwargs, exc, message):
    q, k, v, cu, longest = _qkv()
    args = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": longest, "max_seqlen_k": longest}
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        varlen_attention(q, k, v, **args, backend="reference")


def test_resolve_backend_same_contract():
    q, k, v, cu, longest = _qkv()
    ref = resolve_backend("auto", q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen=longest)
    got = resolve_backend("auto", q, k, v, cu_seqlens_q=cu.tolist(), max_seqlen=np.int64(longest))
    assert str(got) == str(ref)
    with pytest.raises(TypeError, match=r"max_seqlen must be a Python int .* meta"):
        resolve_backend("auto", q, max_seqlen=torch.tensor(4, device=META))


# ---------------------------------------------------------------------------------------------------------
# gated-delta ops and the short conv
# ---------------------------------------------------------------------------------------------------------
def _gdn_inputs(lengths=(5, 1, 9), hk=2, h=4, dk=8, dv=4):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q, k = (torch.randn(1, t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(1, t, h, dv, generator=g)
    decay = torch.nn.functional.logsigmoid(torch.randn(1, t, h, generator=g) + 2.0)
    beta = torch.rand(1, t, h, generator=g)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return (q, k, v, decay, beta), cu


@pytest.mark.parametrize(
    "op",
    [
        chunk_gated_delta_rule,
        naive_recurrent_gated_delta_rule,
        lambda *a, **kw: gated_delta_rule(*a, backend="chunk", **kw),
    ],
    ids=["chunk", "naive", "dispatch"],
)
def test_gated_delta_ops_accept_list_offsets_exactly(op):
    ins, cu = _gdn_inputs()
    ref_o, ref_s = op(*ins, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for alt in (cu.tolist(), tuple(cu.tolist()), cu.numpy().astype(np.int64)):
        o, s = op(*ins, cu_seqlens=alt, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.equal(o, ref_o) and torch.equal(s, ref_s)
    # negative control: the offsets are read (one sequence over the row gives another output)
    o, _ = op(*ins, cu_seqlens=[0, ins[0].shape[1]], use_qk_l2norm_in_kernel=True)
    assert not torch.allclose(o, ref_o)
    with pytest.raises(TypeError, match=r"cu_seqlens must hold integers, got a list of dtype float64"):
        op(*ins, cu_seqlens=[0, 5, 6, 15.0])
    with pytest.raises(TypeError, match=r"cu_seqlens must be an int32/int64 tensor .*torch.bool"):
        op(*ins, cu_seqlens=torch.tensor([True, True]))


def test_chunk_layout_refuses_float_offsets_instead_of_truncating():
    layout = prepare_chunk_layout([0, 5, 6, 15])
    assert layout.total_tokens == 15 and layout.num_seqs == 3
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        prepare_chunk_layout([0, 2.5, 6])  # np.asarray(..., dtype=int64) used to make it [0, 2, 6]


def test_short_conv_accepts_list_offsets_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 15, 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    ref = short_conv(x, w, None, "silu", cu_seqlens=cu)
    assert torch.equal(short_conv(x, w, None, "silu", cu_seqlens=cu.tolist()), ref)
    assert torch.equal(short_conv(x, w, None, "silu", cu_seqlens=cu.numpy()), ref)
    assert torch.equal(short_conv(x, w, None, "silu", seq_idx=seq_idx_from_cu_seqlens(cu, 15).tolist()), ref)
    assert not torch.allclose(short_conv(x, w, None, "silu", cu_seqlens=[0, 15]), ref)
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        short_conv(x, w, None, "silu", cu_seqlens=[0, 5.0, 15])
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        seq_idx_for_conv([0, 2.5, 6])


# ---------------------------------------------------------------------------------------------------------
# PaddingFreeCollator: scalar / None / nested token fields
# ---------------------------------------------------------------------------------------------------------
def _sample(sid, n=3, **fields):
    s = {"input_ids": list(range(1, n + 1)), "labels": [-100] + list(range(2, n + 1)), "sample_id": sid}
    s.update(fields)
    return s


@pytest.mark.parametrize(
    "field, value, described",
    [
        ("labels", 1, r"is an int \(1\)"),  # classification rows
        ("labels", None, "is None"),
        ("labels", np.int64(1), r"is an int64"),
        ("labels", torch.tensor(1), r"is a scalar Tensor \(shape \(\)\)"),
        ("labels", "positive", r"is a str \('positive'\)"),
        ("labels", [[-100, 2, 3]], "has length 1"),
        ("loss_scale", 1.0, r"is a float \(1.0\)"),
        ("loss_scale", None, "is None"),
        ("token_type_ids", 0, r"is an int \(0\)"),
        ("mm_token_type_ids", None, "is None"),
        ("attention_mask", 1, r"is an int \(1\)"),
        ("advantages", 0.5, r"is a float \(0.5\)"),  # an extra_fields field
    ],
)
def test_collator_scalar_token_fields_name_sample_and_field(field, value, described):
    first = {"loss_scale": [1.0] * 3, "token_type_ids": [0] * 3, "advantages": [0.0] * 3}
    first = {k: v for k, v in first.items() if k == field}
    collate = PaddingFreeCollator(extra_fields=["advantages"])
    with pytest.raises(
        ValueError, match=rf"sample 7 \(#1 of the batch\): token-aligned field '{field}' .*{described}"
    ):
        collate([_sample(0, **first), _sample(7, **{field: value})])


@pytest.mark.parametrize(
    "value, described",
    [(5, r"is an int \(5\)"), (None, "is None"), ("hello", r"is a str"), (torch.tensor(5), r"scalar Tensor")],
)
def test_collator_scalar_input_ids_name_sample_and_field(value, described):
    with pytest.raises(
        ValueError, match=rf"sample 7 \(#1 of the batch\): field 'input_ids' must be 1-D .*{described}"
    ):
        PaddingFreeCollator()([_sample(0), _sample(7, input_ids=value)])
    bad = _sample(7, input_ids=value)
    del bad["sample_id"]
    with pytest.raises(ValueError, match=r"sample #1 of the batch \(no sample_id\): field 'input_ids'"):
        PaddingFreeCollator()([_sample(0), bad])


def test_collator_nested_token_field_is_refused_not_flattened():
    s = _sample(7, input_ids=[[1, 2, 3]], labels=[[-100, 2, 3]])
    with pytest.raises(
        ValueError, match=r"sample 7 \(#0 of the batch\): field 'input_ids' .*one value per token"
    ):
        PaddingFreeCollator()([s])


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"length": None}, r"sample 7 \(#1 of the batch\): field 'length' must be an integer token count"),
        ({"length": 3.0}, r"field 'length' must be an integer .* float"),
        (
            {"position_ids": None},
            r"sample 7 \(#1 of the batch\): field 'position_ids' must be integer .* None",
        ),
        ({"position_ids": 0}, r"field 'position_ids' must be integer positions"),
        ({"position_ids": [0.0, 1.0, 2.0]}, r"field 'position_ids' must be integer .* float64"),
        (
            {"pixel_values": None, "image_grid_thw": None},
            r"sample 7 \(#1 of the batch\): media field 'pixel_values' .* is None",
        ),
        (
            {"pixel_values": np.zeros((4, 3)), "image_grid_thw": 5},
            r"media field 'image_grid_thw' .* is an int \(5\)",
        ),
        (
            {"pixel_values": np.zeros((4, 3)), "image_grid_thw": [1.0, 2.0, 2.0]},
            r"'image_grid_thw' must be integer \(t, h, w\) rows",
        ),
    ],
)
def test_collator_other_fields_name_sample_and_field(fields, message):
    with pytest.raises(ValueError, match=message):
        PaddingFreeCollator()([_sample(0), _sample(7, **fields)])


def test_collator_accepts_every_1d_sequence_kind_exactly():
    ref = PaddingFreeCollator()([_sample(0, loss_scale=[1.0] * 3), _sample(7, loss_scale=[1.0, 0.5, 1.0])])
    alt = _sample(7, labels=(-100, 2, 3), loss_scale=np.array([1.0, 0.5, 1.0]), length=np.int64(3))
    alt["input_ids"] = torch.tensor(alt["input_ids"])
    got = PaddingFreeCollator()([_sample(0, loss_scale=(1.0, 1.0, 1.0)), alt])
    for key in ("input_ids", "labels", "loss_scale", "position_ids", "cu_seq_lens_q", "seq_idx"):
        assert torch.equal(got[key], ref[key]), key
    assert got["max_length_q"] == ref["max_length_q"] == 3
