"""benchmarks/profile_step.py and its kernel attribution (benchmarks/_profile_attr.py): device kernels
only, every kernel in one category, a table that adds up, and a check that fails when an annotation range is
counted as a kernel. Pure functions over hand-built records, plus the adapter from torch.profiler events (fake
``FunctionEvent`` objects with the attributes it reads), all on CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import _profile_attr as A

COMPILED = "## Call CompiledFxGraph fabc123 ##"


def _k(name, start, dur, parents=(), stream=7, **kw):
    return A.Event(
        name=name, device="cuda", start_us=start, dur_us=dur, parents=tuple(parents), stream=stream, **kw
    )


def _step():
    """One compiled step: a GPU-side annotation span around 3 Triton kernels and a GEMM, eager attention
    (FA4), an LM-head GEMM, the fused AdamW kernel, a memcpy and host events (launch calls, host ranges)."""
    fwd = (COMPILED, "CompiledFunction")
    return [
        A.Event(COMPILED, "cuda", 0.0, 40.0, is_annotation=True, stream=7),  # GPU-side span: not a kernel
        A.Event(COMPILED, "cpu", 0.0, 30.0, is_annotation=True),
        A.Event("cudaLaunchKernel", "cpu", 1.0, 2.0),
        _k("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 0.0, 5.0, ("triton_red_fused_0", *fwd)),
        _k("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 5.0, 20.0, ("aten::mm", *fwd)),
        _k("triton_poi_fused_mul_silu_1", 25.0, 5.0, ("triton_poi_fused_mul_silu_1", *fwd)),
        _k("triton_per_fused_add_mul_2", 30.0, 10.0, ("triton_per_fused_add_mul_2", *fwd)),
        _k("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90", 40.0, 30.0, ("FlashAttnVarlenFunc",)),
        _k("sm90_xmma_gemm_bf16bf16_bf16f32", 70.0, 12.0, ("aten::mm", "aten::linear"), vocab_dim=True),
        _k(
            "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            82.0,
            8.0,
            ("aten::_fused_adamw_",),
        ),
        _k("Memcpy HtoD (Pinned -> Device)", 90.0, 1.0, ("aten::copy_", "aten::to")),
        _k("some_unknown_kernel", 100.0, 2.0),  # not linked, unknown name
    ]


def test_annotation_spans_and_host_events_are_excluded():
    a = A.attribute(_step())
    assert a.n_annotations == 1 and a.annotation_us == 40.0
    assert a.n_kernels == 8 and a.n_copies == 1
    assert a.kernel_total_us == pytest.approx(5 + 20 + 5 + 10 + 30 + 12 + 8 + 1 + 2)
    assert A.check(a) == []


def test_kernels_categorised_inductor_triton_by_name():
    a = A.attribute(_step())
    by_name = {name: cat for name, cat, _, _ in a.top}
    assert by_name["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"] == "elementwise / norm"
    assert by_name["triton_poi_fused_mul_silu_1"] == "elementwise / norm"
    assert by_name["triton_per_fused_add_mul_2"] == "elementwise / norm"
    assert by_name["nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"] == "GEMM"
    assert by_name["kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90"] == "attention"
    assert by_name["sm90_xmma_gemm_bf16bf16_bf16f32"] == "LM head + loss"
    assert by_name["void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>"] == "optimizer"
    assert by_name["Memcpy HtoD (Pinned -> Device)"] == "memcpy / memset"
    assert by_name["some_unknown_kernel"] == "other"
    assert a.unlinked_us == 2.0


@pytest.mark.parametrize(
    "name, parents, want",
    [
        ("triton_poi_fused_add_0", (), "elementwise / norm"),  # no host parent: by name
        ("triton_red_fused__log_softmax_3", (), "LM head + loss"),
        ("triton_tem_fused_mm_4", (), "GEMM"),
        ("attn_fwd", (), "attention"),  # varpack's Triton attention
        (
            "triton_poi_fused_embedding_dense_backward_5",
            ("triton_poi_fused_embedding_dense_backward_5",),
            "embedding",
        ),
        ("elementwise_kernel", ("aten::mul",), "elementwise / norm"),
        (
            "elementwise_kernel",
            ("aten::mul", "autograd::engine::evaluate_function: VarlenAttnBackward"),
            "attention",
        ),
        ("Memset (Device)", (), "memcpy / memset"),
        # a compiled graph's cache key never makes its kernels attention
        (
            "triton_poi_fused_6",
            ("triton_poi_fused_6", "## Call CompiledFxGraph flexsdpa ##"),
            "elementwise / norm",
        ),
    ],
)
def test_categorize_rules(name, parents, want):
    assert A.categorize(_k(name, 0.0, 1.0, parents)) == want


def test_table_adds_up_per_step():
    evts = _step()
    a = A.attribute(evts)
    t = A.per_step(a, steps=2, wall_us=300.0)
    assert sum(t["kernel_ms_per_step"].values()) == pytest.approx(t["kernel_total_ms_per_step"])
    assert t["kernel_total_ms_per_step"] == pytest.approx(93.0 / 2 / 1e3)
    # one stream, serial kernels with a gap [91, 100): busy = kernel total, no overlap
    assert t["busy_ms_per_step"] == pytest.approx(t["kernel_total_ms_per_step"])
    assert t["host_gap_ms_per_step"] + t["busy_ms_per_step"] == pytest.approx(t["wall_ms_per_step"])
    assert t["kernels_per_step"] == 4.0 and t["annotation_spans_excluded_per_step"] == 0.5
    for c in A.CATEGORIES:
        assert t["busy_ms_per_step_by_category"][c] <= t["kernel_ms_per_step"][c] + 1e-12


def test_two_streams_overlap_is_not_an_error():
    evts = [
        _k("nvjet_a", 0.0, 10.0, ("aten::mm",), stream=7),
        _k("nvjet_b", 5.0, 10.0, ("aten::mm",), stream=9),
    ]
    a = A.attribute(evts)
    assert a.kernel_total_us == 20.0 and a.busy_us == 15.0
    assert A.check(a) == []


def test_negative_control_annotation_counted_as_kernel_fails_the_check():
    """The same step with the GPU-side ``## Call CompiledFxGraph ##`` span not flagged as an annotation (what
    the old profile_step did): it encloses kernels of its stream, and the check says so."""
    evts = [
        e
        if not (e.device == "cuda" and e.is_annotation)
        else A.Event(**{**e.__dict__, "is_annotation": False})
        for e in _step()
    ]
    a = A.attribute(evts)
    problems = A.check(a)
    assert problems and "overlap" in problems[0] and COMPILED in problems[0]
    assert a.stream_overlap_us[7] == pytest.approx(40.0)  # the span's length: every kernel it encloses
    assert a.kernel_total_us == pytest.approx(93.0 + 40.0)


def test_negative_control_lost_kernel_fails_the_sum():
    a = A.attribute(_step())
    a.kernel_us["GEMM"] -= 20.0  # a kernel dropped from its category
    problems = A.check(a)
    assert problems and problems[0].startswith("categories sum")


# --- the adapter from torch.profiler events (fake FunctionEvents) -------------------------------------------


def _fe(id, name, device_type, start, end, parent=None, ann=False, shapes=(), children=(), resource=7):
    return SimpleNamespace(
        id=id,
        name=name,
        device_type=device_type,
        time_range=SimpleNamespace(start=start, end=end),
        cpu_parent=parent,
        cpu_children=list(children),
        is_user_annotation=ann,
        input_shapes=list(shapes),
        device_resource_id=resource,
        thread=1,
        linked_correlation_id=0,
    )


def test_events_from_profiler_flags_annotations_and_links_triton_launches():
    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    graph = _fe(1, COMPILED, cpu, 0.0, 50.0, ann=True)
    triton_range = _fe(2, "triton_poi_fused_mul_silu_1", cpu, 1.0, 5.0, parent=graph)
    launch = _fe(300, "cuLaunchKernel", cpu, 2.0, 3.0, parent=triton_range)
    mm = _fe(3, "aten::mm", cpu, 6.0, 9.0, parent=graph, shapes=[[8192, 1024], [1024, 151936]])
    launch2 = _fe(301, "cudaLaunchKernel", cpu, 7.0, 8.0, parent=mm)
    events = [
        graph,
        triton_range,
        launch,
        mm,
        launch2,
        _fe(300, "triton_poi_fused_mul_silu_1", cuda, 10.0, 15.0),
        _fe(301, "nvjet_tst_128x256", cuda, 15.0, 35.0),
        _fe(1, COMPILED, cuda, 10.0, 35.0, ann=True),  # the GPU-side span
    ]
    recs = A.events_from_profiler(events, vocab=151936, device_type="cuda")
    assert [r.name for r in recs] == ["triton_poi_fused_mul_silu_1", "nvjet_tst_128x256", COMPILED]
    assert [r.is_annotation for r in recs] == [False, False, True]
    assert recs[0].parents == ("triton_poi_fused_mul_silu_1", COMPILED)
    assert recs[1].vocab_dim
    a = A.attribute(recs)
    assert a.n_kernels == 2 and a.n_annotations == 1 and A.check(a) == []
    assert a.kernel_us["elementwise / norm"] == 5.0 and a.kernel_us["LM head + loss"] == 20.0


def test_events_from_profiler_refuses_events_without_annotation_flag():
    from torch.autograd import DeviceType

    evt = _fe(5, "k", DeviceType.CUDA, 0.0, 1.0)
    del evt.is_user_annotation
    with pytest.raises(RuntimeError, match="is_user_annotation"):
        A.events_from_profiler([evt], vocab=10, device_type="cuda")


def test_real_cpu_profile_adds_up():
    """A real torch.profiler CPU trace through the adapter's CPU path (leaf ATen ops stand in for kernels);
    ``record_function`` ranges are user annotations in this torch (the flag the CUDA path relies on)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function("## Call CompiledFxGraph test ##"):
            torch.nn.functional.silu(x @ x).sum()
    events = list(prof.events())
    assert any(e.is_user_annotation for e in events if e.name == "## Call CompiledFxGraph test ##")
    recs = A.events_from_profiler(events, vocab=151936, device_type="cpu")
    assert recs and all(r.name.startswith("aten::") for r in recs)
    a = A.attribute(recs, device="cpu")
    assert A.check(a) == [] and a.kernel_us["GEMM"] > 0
    assert sum(a.kernel_us.values()) == pytest.approx(a.kernel_total_us)


@pytest.mark.parametrize("config", ["varpack_lce", "varpack_lce_static_compile_ops"])
def test_small_run_adds_up(tmp_path, capsys, config):
    """--small on the CPU: the table adds up (exit 0; the check would exit 1) and --out holds the figures; a static
    config too (its shape is train.py's, from the model built on the meta device)."""
    import json

    from benchmarks import profile_step as P

    out = tmp_path / "profile.json"
    assert P.main(["--device", "cpu", "--small", "--config", config, "--attn-host-calls", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["check_problems"] == [] and data["step_ms_without_profiler"] > 0
    assert sum(data["kernel_ms_per_step"].values()) == pytest.approx(data["kernel_total_ms_per_step"])
    assert "check: categories sum" in capsys.readouterr().out


def test_device_gaps_split_short_bubbles_from_waits_for_the_host():
    """Idle device time between kernels: gaps under LONG_GAP_US are summed as bubbles, longer ones grouped by
    the work that ends them (its launching op, wrappers skipped); work on two streams that overlaps leaves no
    gap; idle before the first kernel is not a gap."""
    fwd = (COMPILED, "CompiledFunction")
    events = [
        _k("triton_poi_fused_mul_silu_1", 100.0, 5.0, ("triton_poi_fused_mul_silu_1", *fwd)),
        _k("nvjet_tst_a", 107.0, 20.0, ("aten::mm", *fwd)),  # 2 us bubble
        _k("nvjet_tst_b", 120.0, 10.0, ("aten::mm",), stream=9),  # overlaps the one before: no gap
        _k("nvjet_tst_c", 177.0, 3.0, ("aten::mm", *fwd)),  # 47 us wait
        _k("triton_poi_fused_add_2", 185.0, 1.0, ("triton_poi_fused_add_2", "aten::add", *fwd)),  # 5 us bubble
        _k("nvjet_tst_d", 236.0, 4.0, ("aten::mm",)),  # 50 us wait
        _k("void at::native::multi_tensor_apply_kernel<FusedAdam>", 300.0, 8.0, ("aten::_fused_adamw_",)),
    ]
    short_us, n_short, long = A.device_gaps(events)
    assert (short_us, n_short) == (pytest.approx(7.0), 2)
    assert long == [("GEMM: aten::mm", pytest.approx(97.0), 2), ("optimizer: aten::_fused_adamw_", 60.0, 1)]
    a = A.attribute(events)
    assert (a.short_gap_us, a.n_short_gaps, a.long_gaps) == (short_us, n_short, long)
    assert (a.long_gap_us, a.n_long_gaps) == (pytest.approx(157.0), 3)
    assert A.gap_label(events[4]) == "elementwise / norm: aten::add"
    out = A.per_step(a, 2, 400.0)
    assert out["short_gap_ms_per_step"] == pytest.approx(7.0e-3 / 2)
    assert out["long_gap_ms_per_step"] == pytest.approx(157e-3 / 2) and out["long_gaps_per_step"] == 1.5
    assert out["long_gaps"][0] == {"before": "GEMM: aten::mm", "ms_per_step": pytest.approx(97e-3 / 2),
                                   "gaps_per_step": 1.0}  # fmt: skip
    # the busy time and the gaps account for the span from the first kernel's start to the last one's end
    long_us = sum(us for _, us, _ in long)
    assert a.busy_us + short_us + long_us == pytest.approx(308.0 - 100.0)
    assert [k[0] for k in a.top_by_category["GEMM"]] == ["nvjet_tst_a", "nvjet_tst_b", "nvjet_tst_d", "nvjet_tst_c"]


def test_long_gap_total_counts_the_groups_left_out_of_the_top():
    """30 kernels, each after a 20 us wait and launched by its own op: the top lists 20 groups, the total all 29
    gaps, and busy + gaps fill the span."""
    events = [_k(f"k{i}", 30.0 * i, 10.0, (f"aten::op{i}",)) for i in range(30)]
    a = A.attribute(events, top=20)
    assert len(a.long_gaps) == 20 and (a.long_gap_us, a.n_long_gaps) == (pytest.approx(580.0), 29)
    assert a.busy_us + a.short_gap_us + a.long_gap_us == pytest.approx(30.0 * 29 + 10.0)
