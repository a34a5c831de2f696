"""benchmarks/hybrid_step.py's HF peers, on the CPU with ``tiny-qwen3.5`` in fp32, and its --small run.

The exact peer (``hf_padded_torch``: HF right-padded micro-batches with gradient accumulation and
transformers' reference Gated DeltaNet functions) must give varpack's packed loss AND gradients on the same
samples; HF's padding-free row with the reference functions (``hf_flat_torch``) must not (negative control:
its short conv and recurrent state run across the sample boundaries), so the comparison can fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import pytest
import torch

from benchmarks import hybrid_step as H
from benchmarks._common import synthetic_samples

CPU = torch.device("cpu")
VOCAB = 512


def _args(**kw) -> argparse.Namespace:
    values = dict(
        model="tiny-qwen3.5",
        vocab_size=VOCAB,
        overrides=None,
        loss_impl="logits",
        hf_attn="sdpa",
        pad_tokens=96,
    )
    values.update(kw)
    return argparse.Namespace(**values)


@pytest.fixture(scope="module")
def wl() -> H.Workload:
    samples = synthetic_samples(60, vocab=VOCAB, mu=3.4, sigma=0.5, lo=8, hi=120, seed=1)
    return H.workload(samples, 256, 1)


def _first_step(config: str, wl: H.Workload, args: argparse.Namespace):
    """Loss, gradients and info of the first step of ``config`` (no optimizer step)."""
    counts = [H.supervised_count(p) for p in wl.packs]
    with contextlib.ExitStack() as stack:
        row = H.build_row(config, args, wl, CPU, torch.float32, stack)
        loss = H.step_loss(row, 0, counts, CPU)
        grads = {n: p.grad.detach().clone() for n, p in row.model.named_parameters() if p.grad is not None}
    return float(loss), grads, row.info, row.steps


def _mismatched(got: dict, want: dict) -> list[str]:
    """Parameters whose gradients differ beyond fp32 rounding. The absolute floor covers the decay
    parameters (``A_log`` / ``dt_bias``), whose gradients are ~1e-8 sums of cancelling terms (varpack's own
    ``naive`` and ``chunk`` backends differ there by more than this peer does)."""
    return [n for n, g in want.items() if not torch.allclose(got[n], g, rtol=1e-4, atol=1e-7)]


@pytest.fixture(scope="module")
def varpack_step(wl):
    return _first_step("chunk", wl, _args())


def test_workload_same_samples(wl):
    batch, pack = wl.batches[0], wl.packs[0]
    assert len(pack) >= 4  # several samples: boundaries to keep apart
    assert [len(s["input_ids"]) for s in pack] == torch.diff(batch["cu_seq_lens_q"]).tolist()
    assert torch.equal(batch["input_ids"][0], torch.tensor([t for s in pack for t in s["input_ids"]]))
    assert wl.tokens == batch["input_ids"].numel()


def test_padded_steps_budget_and_coverage(wl):
    (step,) = H.padded_steps(wl.packs, pad_tokens=96)
    assert len(step) > 1  # gradient accumulation over several micro-batches
    seen = []
    for mb in step:
        B, L = mb["input_ids"].shape
        assert B * L <= 96 or B == 1
        for ids, mask, labels in zip(mb["input_ids"], mb["attention_mask"], mb["labels"]):
            n = int(mask.sum())
            assert bool(mask[:n].all()) and not bool(mask[n:].any())  # right padding
            assert bool((labels[n:] == H.IGNORE).all())
            seen.append(ids[:n].tolist())
    assert sorted(seen) == sorted(s["input_ids"] for s in wl.packs[0])


def test_padded_peer_matches_varpack_loss_and_grads(wl, varpack_step):
    loss_v, grads_v, _, _ = varpack_step
    loss_p, grads_p, info, steps = _first_step("hf_padded_torch", wl, _args())
    assert len(steps[0]) > 1
    assert info["exact"].startswith("yes")
    assert set(info["hf_linear_impls"].values()) == {"torch reference"}
    assert loss_p == pytest.approx(loss_v, rel=1e-5)
    assert grads_p.keys() == grads_v.keys()
    assert _mismatched(grads_p, grads_v) == []


def test_padded_peer_matches_varpack_linear_ce(wl, varpack_step):
    loss_lce, _, info, _ = _first_step("chunk", wl, _args(loss_impl="linear_ce"))
    assert info["loss_impl"] == "linear_ce"
    assert loss_lce == pytest.approx(varpack_step[0], rel=1e-5)


def test_compiled_layers_row_matches_the_eager_row(wl, varpack_step):
    """``chunk_compiled_layers``: the same step with every decoder layer compiled whole (aot_eager here), the
    same loss and gradients as the eager ``chunk`` row (which the exact peer matches above)."""
    loss_v, grads_v, _, _ = varpack_step
    loss_c, grads_c, info, _ = _first_step("chunk_compiled_layers", wl, _args(compile_backend="aot_eager"))
    assert info["compiled_layers"] == "aot_eager, custom_ops, fullgraph"
    assert loss_c == pytest.approx(loss_v, rel=1e-5)
    assert grads_c.keys() == grads_v.keys()
    assert _mismatched(grads_c, grads_v) == []
    assert H.varpack_base("fla_hybrid_compiled_layers") == ("fla_hybrid", "custom_ops")
    assert H.varpack_base("fla_hybrid_compiled_breaks") == ("fla_hybrid", "graph_breaks")
    assert H.varpack_base("fla_hybrid") == ("fla_hybrid", None)
    assert H.varpack_base("chunk") == ("chunk", None)


def test_flat_reference_leaks_negative_control(wl, varpack_step):
    loss_v, grads_v, _, _ = varpack_step
    loss_f, grads_f, info, steps = _first_step("hf_flat_torch", wl, _args())
    assert steps[0][0]["input_ids"].shape == (1, wl.tokens)  # one padding-free row, as varpack's
    assert info["exact"] == "NO: short conv and recurrent state leak across samples"
    assert loss_f != loss_v  # at random init the leak moves the loss only by ~1e-6: the gradients show it
    bad = _mismatched(grads_f, grads_v)
    assert "model.layers.0.linear_attn.conv1d.weight" in bad
    assert len(bad) > len(grads_v) // 2


def test_hf_flat_without_kernels_leaks_or_refuses(wl, varpack_step):
    """Without fla / causal_conv1d (this CPU), HF's padding-free row with TRL's boundary kwargs is not exact:
    transformers 5.17 leaks silently, later releases raise ValueError on the reference path."""
    try:
        _, grads, info, _ = _first_step("hf_flat", wl, _args())
    except ValueError as exc:
        assert "packed sequences" in str(exc)
        return
    assert info["exact"].startswith("NO")
    assert _mismatched(grads, varpack_step[1])


def test_reference_functions_restored(wl):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    before = {n: getattr(m, n) for n in H.HF_LINEAR_FUNCS}
    with contextlib.ExitStack() as stack:
        H.build_row("hf_padded_torch", _args(), wl, CPU, torch.float32, stack)
        assert all(getattr(m, n) is H.transformers_wrapper(before[n]).__wrapped__ for n in H.HF_LINEAR_FUNCS)
    assert all(getattr(m, n) is before[n] for n in H.HF_LINEAR_FUNCS)


def test_flat_exactness_labels():
    fla = {"torch_chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule"}
    conv = {"causal_conv1d_fn": "causal_conv1d.causal_conv1d_interface.causal_conv1d_fn"}
    assert H.flat_exactness({**fla, **conv}, True).startswith("yes")
    assert (
        H.flat_exactness({**fla, **conv}, False) == "NO: short conv and recurrent state leak across samples"
    )
    assert H.flat_exactness(fla, True) == "NO: short conv leak across samples"
    assert H.flat_exactness(conv, True) == "NO: recurrent state leak across samples"


def test_summary_ratio_to_best_exact_peer():
    rows = [
        [
            {"config": "chunk", "ms_per_step": 100.0, "tokens_per_s": 10.0, "peak_gib": None},
            {"config": "hf_padded_torch", "ms_per_step": 400.0, "tokens_per_s": 2.5, "peak_gib": None},
            {"config": "hf_flat_torch", "ms_per_step": 50.0, "tokens_per_s": 20.0, "peak_gib": None},
            {"config": "hf_padded", "error": "RuntimeError: backward"},
        ]
    ]
    out = {
        r["config"]: r for r in H.summary(["chunk", "hf_padded_torch", "hf_flat_torch", "hf_padded"], rows)
    }
    assert out["chunk"]["speed_vs_best_exact_peer"] == pytest.approx(4.0)  # the leaking row is no peer
    assert out["chunk"]["best_exact_peer"] == "hf_padded_torch"
    assert out["hf_flat_torch"]["speed_vs_first"] == pytest.approx(2.0)
    assert out["hf_padded"]["error"].startswith("RuntimeError")


def test_small_run_on_the_cpu(tmp_path, capsys):
    """--small: the varpack row, the exact peer and the leaking row in one run; the same first-step loss up to
    rounding (a leak moves it only slightly at random init), the exactness column says which row leaks."""
    out = tmp_path / "hybrid.json"
    argv = ["--device", "cpu", "--small", "--steps", "1", "--rounds", "1", "--backends",
            "chunk,hf_padded_torch,hf_flat_torch", "--out", str(out)]  # fmt: skip
    assert H.main(argv) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["summary"]}
    assert set(rows) == {"chunk", "hf_padded_torch", "hf_flat_torch"} and not any(
        "error" in r for r in rows.values()
    )
    assert rows["chunk"]["exact"].startswith("yes") and rows["hf_flat_torch"]["exact"].startswith("NO")
    assert rows["chunk"]["loss_first"] == pytest.approx(rows["hf_padded_torch"]["loss_first"], rel=1e-4)
    assert rows["chunk"]["speed_vs_best_exact_peer"] > 0 and "| chunk | yes" in capsys.readouterr().out


def test_small_compiled_layers_run_on_the_cpu(tmp_path):
    """--small with the compiled-layers row (``--compile-backend aot_eager``): it runs and its first-step loss
    is the eager row's."""
    out = tmp_path / "hybrid.json"
    argv = ["--device", "cpu", "--small", "--steps", "1", "--rounds", "1", "--backends",
            "chunk,chunk_compiled_layers,chunk_compiled_breaks", "--compile-backend", "aot_eager", "--out",
            str(out)]  # fmt: skip
    assert H.main(argv) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["summary"]}
    assert set(rows) == {"chunk", "chunk_compiled_layers", "chunk_compiled_breaks"}
    assert not any("error" in r for r in rows.values())
    assert rows["chunk_compiled_layers"]["compiled_layers"] == "aot_eager, custom_ops, fullgraph"
    assert rows["chunk_compiled_breaks"]["compiled_layers"] == "aot_eager, mixers as graph breaks"
    for name in ("chunk_compiled_layers", "chunk_compiled_breaks"):
        assert rows[name]["loss_first"] == pytest.approx(rows["chunk"]["loss_first"], rel=1e-5)


def test_static_batches_are_the_packs_padded_to_one_shape(wl, varpack_step):
    """The ``_graphs`` rows' batches: one static shape for every pack, the pack's tokens first, pad segments
    after them with nothing supervised; the same model on a static batch gives the dynamic batch's loss and
    gradients (the pads add no loss and carry no state into a sample)."""
    shapes = {tuple(b["input_ids"].shape) for b in wl.static_batches}
    metas = {(int(b["varlen_meta"].total_q), int(b["varlen_meta"].num_seqs)) for b in wl.static_batches}
    assert len(shapes) == 1 and len(metas) == 1
    for dyn, stat in zip(wl.batches, wl.static_batches):
        n = dyn["input_ids"].shape[-1]
        assert stat["input_ids"].shape[-1] >= n and torch.equal(stat["input_ids"][..., :n], dyn["input_ids"])
        assert bool((stat["labels"][..., n:] == -100).all())
    counts = [H.supervised_count(p) for p in wl.packs]
    with contextlib.ExitStack() as stack:
        row = H.build_row("chunk", _args(), wl, CPU, torch.float32, stack)
        row.steps = [[b] for b in wl.static_batches]
        loss = float(H.step_loss(row, 0, counts, CPU))
        grads = {n: p.grad for n, p in row.model.named_parameters() if p.grad is not None}
    want_loss, want_grads, _, _ = varpack_step
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert grads.keys() == want_grads.keys() and not _mismatched(grads, want_grads)


def test_graphs_row_names_its_mode_and_needs_cuda(wl):
    assert H.varpack_base("fla_hybrid_graphs") == ("fla_hybrid", "graphs")
    with contextlib.ExitStack() as stack, pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        H.build_row("chunk_graphs", _args(), wl, CPU, torch.float32, stack)
