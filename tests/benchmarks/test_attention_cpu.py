"""benchmarks/attention_cpu.py --small: the per-segment slicing loop and the backends' one split give
bit-identical outputs and gradients, each timed in the same run."""

from __future__ import annotations

import json

from benchmarks.attention_cpu import main


def test_small_run_slice_and_split_agree(tmp_path, capsys):
    out = tmp_path / "attention_cpu.json"
    assert main(["--small", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["mode"]) for r in rows} == {
        (b, m) for b in ("sdpa", "reference") for m in ("fwd", "fwd+bwd")
    }
    for r in rows:
        assert r["max_abs_diff_out"] == 0 and r["max_abs_diff_grad"] in (0, None)
        assert r["slice_ms"] > 0 and r["split_ms"] > 0
    assert "| sdpa | 64x8 | fwd+bwd |" in capsys.readouterr().out
