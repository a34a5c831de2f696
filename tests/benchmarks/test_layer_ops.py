"""benchmarks/layer_ops.py --small: ATen ops per decoder layer, the backward adding to the forward's."""

from __future__ import annotations

import json

from benchmarks.layer_ops import main


def test_small_run_counts_ops(tmp_path):
    out = tmp_path / "ops.json"
    assert main(["--small", "--out", str(out)]) == 0
    (fwd, fwd_bwd) = json.loads(out.read_text())["rows"]
    assert 0 < fwd[2] <= fwd[1] and fwd_bwd[2] > fwd[2] and fwd_bwd[3] == 28 * fwd_bwd[2]
