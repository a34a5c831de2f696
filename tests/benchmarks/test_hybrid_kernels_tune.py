"""benchmarks/hybrid_kernels_tune.py --small on the CPU (Triton's interpreter): each launch config of the dq/dk
kernel and of the split convolution's backward runs, gives the default config's results, and the best is the
fastest timed row."""

from __future__ import annotations

import json

import pytest

from varpack._triton import triton_interpreted


def test_small_sweep_on_the_cpu_times_and_checks_every_config(tmp_path):
    if not triton_interpreted():
        pytest.skip("the kernels run on the CPU only under TRITON_INTERPRET=1")
    from benchmarks.hybrid_kernels_tune import DQKWG_GRID, main, rel_diff

    out = tmp_path / "tune.json"
    argv = ["--device", "cpu", "--small", "--kernels", "dqkwg,conv_bwd", "--max-configs", "2", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data["records"]) == {"dqkwg", "conv_bwd"}
    for kind, rec in data["records"].items():
        timed = [r for r in rec["rows"] if "ms" in r]
        assert len(timed) == 2 and not [r for r in rec["rows"] if "error" in r], rec["rows"]
        assert rec["best"] == min(timed, key=lambda r: r["ms"])
        # another launch computes the same gradients: fp32 sums in another order at most
        assert all(r["max_rel_diff_vs_default"] < 1e-5 for r in timed), (kind, timed)
    dq = data["records"]["dqkwg"]
    assert set(dq["rows"][0]["config"]) == set(DQKWG_GRID)
    # at head dim 32 the swept launches split the key / value blocks unlike the default (capped to 32, 32)
    assert [(r["config"]["block_k"], r["config"]["block_v"]) for r in dq["rows"]] == [(16, 16), (16, 32)]
    assert data["records"]["dqkwg"]["table_rows"] > data["records"]["dqkwg"]["chunks"]  # padding rows ran

    import torch

    a = torch.ones(4)
    assert rel_diff(a, a) == 0 and rel_diff(a * 1.5, a) == 0.5 and rel_diff(a[:2], a) == float("inf")
