"""``auto``'s hook for ``triton_short``: a table of shape classes filled after the H200 measurement,
decided from Python numbers only (``max_seqlen``, mean segment length = Tq / number of segments)."""

from __future__ import annotations

import pytest
import torch

from varpack.attn import CallSpec, interface, registry, varlen_attention
from varpack.attn.registry import TritonShortRule, resolve_spec, triton_short_wanted
from varpack.varlen import VarlenMeta

CUDA = torch.device("cuda")


def _spec(max_seqlen=100, mean_seqlen=60.0, head_dim=128, needs_grad=True, device=CUDA, softcap=0.0):
    return CallSpec(
        device=device, dtype=torch.bfloat16, head_dim=head_dim, num_heads=16, num_kv_heads=4,
        softcap=softcap, needs_grad=needs_grad, max_seqlen=max_seqlen, mean_seqlen=mean_seqlen,
    )  # fmt: skip


@pytest.mark.parametrize(
    "spec_kw,wanted",
    [
        ({"max_seqlen": 128, "mean_seqlen": 74.0}, True),  # the measured short mix (H200, 2026-12-01)
        ({"max_seqlen": 128, "mean_seqlen": 87.4}, True),  # the real data's samples <= 128 tokens (SFT step)
        ({"max_seqlen": 16, "mean_seqlen": 16.0}, True),
        ({"max_seqlen": 128, "mean_seqlen": 74.0, "needs_grad": False}, False),  # forward: a tie, not a row
        ({"max_seqlen": 128, "mean_seqlen": 90.0}, False),  # longer documents than measured
        ({"max_seqlen": 1633, "mean_seqlen": 207.0}, False),  # the real-lengths mix: 1.03x FA4, no row
        ({"max_seqlen": 100, "mean_seqlen": 60.0, "head_dim": 64}, False),  # D = 64 not measured
        ({"max_seqlen": 100, "mean_seqlen": None}, False),  # the compiled op path passes no mean
    ],
)
def test_default_table_is_the_measured_short_training_class(spec_kw, wanted):
    got, why = triton_short_wanted(_spec(**spec_kw))
    assert got is wanted, why
    if not wanted:
        assert "no AUTO_TRITON_SHORT row matches" in why


def test_empty_table_means_never():
    wanted, why = triton_short_wanted(_spec(max_seqlen=16, mean_seqlen=16.0), ())
    assert not wanted and "empty" in why


RULES = (
    TritonShortRule(max_seqlen=128, max_mean_seqlen=None),  # every short-class call
    TritonShortRule(max_seqlen=4096, max_mean_seqlen=256.0, training=True),  # real mixes, training only
)


@pytest.mark.parametrize(
    "spec_kw,wanted",
    [
        ({"max_seqlen": 128, "mean_seqlen": 100.0}, True),  # row 1 (edge: equal is inside)
        ({"max_seqlen": 129, "mean_seqlen": 100.0}, True),  # row 2
        ({"max_seqlen": 129, "mean_seqlen": 100.0, "needs_grad": False}, False),  # row 2 is training only
        ({"max_seqlen": 3000, "mean_seqlen": 256.0}, True),
        ({"max_seqlen": 3000, "mean_seqlen": 256.5}, False),  # mean too long
        ({"max_seqlen": 4097, "mean_seqlen": 20.0}, False),  # one document too long
        (
            {"max_seqlen": 3000, "mean_seqlen": None},
            False,
        ),  # mean unknown: a row that bounds it never matches
        ({"max_seqlen": 100, "mean_seqlen": None}, True),  # row 1 does not bound the mean
        ({"max_seqlen": None, "mean_seqlen": 10.0}, False),  # max_seqlen unknown
        ({"max_seqlen": 100, "head_dim": 96}, False),  # head dim not measured
        ({"max_seqlen": 100, "device": torch.device("cpu")}, False),  # CUDA only
    ],
)
def test_rules_match_from_python_numbers(spec_kw, wanted):
    got, why = triton_short_wanted(_spec(**spec_kw), RULES)
    assert got is wanted, why


def test_resolve_spec_tries_triton_short_first_only_when_a_row_matches(monkeypatch):
    supports = {name: (True, "ok") for name in registry.BACKENDS}
    for name, backend in registry.BACKENDS.items():
        monkeypatch.setattr(backend, "supports", lambda spec, name=name: supports[name])
    monkeypatch.setattr(registry, "AUTO_TRITON_SHORT", RULES)
    picked = resolve_spec("auto", _spec(max_seqlen=100, mean_seqlen=60.0))
    assert picked == "triton_short" and "AUTO_TRITON_SHORT row" in picked.reason
    long_docs = resolve_spec("auto", _spec(max_seqlen=8192, mean_seqlen=2048.0))
    assert long_docs == registry.AUTO_PRIORITY["cuda"][0]
    # a call triton_short refuses (e.g. softcap) falls through to the tables as before, saying why
    supports["triton_short"] = (False, "softcap=30.0 not supported")
    picked = resolve_spec("auto", _spec(max_seqlen=100, mean_seqlen=60.0, softcap=30.0))
    assert picked == registry.AUTO_PRIORITY_SHORT["cuda"][0] and "triton_short: softcap" in picked.reason
    # empty table (the default): the short class resolves exactly as before
    monkeypatch.setattr(registry, "AUTO_TRITON_SHORT", ())
    supports["triton_short"] = (True, "ok")
    assert (
        resolve_spec("auto", _spec(max_seqlen=100, mean_seqlen=60.0))
        == registry.AUTO_PRIORITY_SHORT["cuda"][0]
    )


def test_varlen_attention_passes_the_mean_length_from_shapes(monkeypatch):
    """The public entry point fills ``mean_seqlen = Tq / number of segments`` (shapes only, no sync)."""
    seen = []
    real = interface.resolve_spec

    def spy(name, spec, **kw):
        seen.append(spec)
        return real(name, spec, **kw)

    monkeypatch.setattr(interface, "resolve_spec", spy)
    lens = [3, 17, 1, 11]
    q = torch.randn(sum(lens), 2, 16)
    varlen_attention(q, q, q, meta=VarlenMeta.from_lengths(lens), backend="reference")
    assert seen[-1].mean_seqlen == pytest.approx(32 / 4) and seen[-1].max_seqlen == 17
    picked = registry.resolve_backend(
        "reference", q, cu_seqlens_q=torch.tensor([0, 3, 20, 21, 32], dtype=torch.int32)
    )
    assert picked == "reference"
