"""benchmarks/attention_profile.py: per-kernel mean times (profile_step.py's attribution), and a --small run
on the CPU that writes every timing of each backend (an unknown backend reported, not fatal)."""

from __future__ import annotations

import json

from benchmarks import _profile_attr as A
from benchmarks import attention_profile as AP


def test_kernel_rows_are_per_call_and_skip_annotation_spans():
    """GPU-side spans of autograd ranges enclose the kernels' time; counted as kernels they would double
    it."""
    events = [
        A.Event("_TritonShortFunction", "cuda", 0.0, 300.0, is_annotation=True, parents=("x",)),
        A.Event("attn_fwd", "cuda", 0.0, 300.0, parents=("attn_fwd",)),
        A.Event("attn_bwd_dq", "cuda", 400.0, 900.0, parents=("attn_bwd_dq",)),
    ]
    att = A.attribute(events, top=5)
    rows = AP.kernel_rows(att, 3)
    assert [r["name"] for r in rows] == ["attn_bwd_dq", "attn_fwd"] and rows[0]["us"] == 300.0
    assert att.kernel_total_us == 1200.0


def test_cpu_smoke_run_writes_all_timings(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        AP.main(["--device", "cpu", "--small", "--backends", "reference,nonexistent", "--out", str(out)]) == 0
    )
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    ref = rows["reference"]
    for key in ("queued_ms", "synced_ms", "host_ms", "kernel_sum_ms"):
        assert ref[key] > 0, key
    assert ref["kernels"] and "unknown attention backend" in rows["nonexistent"]["error"]
    assert "| reference |" in capsys.readouterr().out
