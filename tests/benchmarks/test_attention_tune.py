"""benchmarks/attention_tune.py --small on the CPU (Triton's interpreter): the sweep's records, picks and env
JSON are well formed, and the chosen configs parse through the public config parser."""

from __future__ import annotations

import json

import pytest

from varpack.attn import triton_short as ts


def test_small_sweep_on_the_cpu_writes_picks_that_parse(tmp_path):
    if not ts._triton_interpreted():
        pytest.skip("triton_short runs on the CPU only under TRITON_INTERPRET=1")
    from benchmarks.attention_tune import KINDS, SMALL_GRIDS, main

    out = tmp_path / "tune.json"
    rc = main(
        [
            "--device",
            "cpu",
            "--small",
            "--mixes",
            "short",
            "--mask-free",
            "on",
            "--no-check",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["args"]["timing"] == "queued"
    (rec,) = data["records"]
    assert set(rec["best"]) == set(KINDS)
    for kind in KINDS:
        timed = [r for r in rec["rows"] if r["kernel"] == kind and "ms" in r]
        assert {tuple(r["config"]) for r in timed} == set(SMALL_GRIDS[kind])  # every candidate ran
        best = min(timed, key=lambda r: r["ms"])
        assert rec["best"][kind]["config"] == best["config"] and rec["best"][kind]["ms"] == best["ms"]
    picked = ts.TritonShortConfig.from_json(rec["best_env"])
    assert all(getattr(picked, kind) == tuple(rec["best"][kind]["config"]) for kind in KINDS)
    assert ts.TritonShortConfig.from_json(data["overall_env"]).mask_free is True
