"""benchmarks/attention_profile.py (issue 17): per-kernel mean times from profiler events, and a CPU smoke run
that writes every timing of each backend (an unknown backend reported, not fatal)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from benchmarks import attention_profile as AP


def _ev(key, device_us, cpu_us):
    return SimpleNamespace(key=key, self_device_time_total=device_us, self_cpu_time_total=cpu_us)


def test_kernel_times_per_call_largest_first_and_by_device():
    events = [_ev("attn_fwd", 300.0, 5.0), _ev("aten::empty", 0.0, 40.0), _ev("attn_bwd_dq", 900.0, 1.0)]
    assert AP.kernel_times(events, 3, "cuda") == [("attn_bwd_dq", 300.0), ("attn_fwd", 100.0)]
    assert AP.kernel_times(events, 1, "cpu")[0] == ("aten::empty", 40.0)


def test_cpu_smoke_run_writes_all_timings(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert AP.main(["--device", "cpu", "--small", "--backends", "reference,nonexistent", "--out", str(out)]) == 0
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    ref = rows["reference"]
    for key in ("queued_ms", "synced_ms", "host_ms", "kernel_sum_ms"):
        assert ref[key] > 0, key
    assert ref["kernels"] and "unknown attention backend" in rows["nonexistent"]["error"]
    assert "| reference |" in capsys.readouterr().out
