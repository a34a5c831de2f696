"""benchmarks/streaming.py --small: the streaming packer's fill against the global plan of the same
lengths."""

from __future__ import annotations

import json

from benchmarks.streaming import main


def test_small_run_fill_near_the_global_plan(tmp_path):
    out = tmp_path / "streaming.json"
    assert main(["--small", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * 2  # three streams x two buffers
    assert all(r["fill"] / r["global_fill"] > 0.98 and r["samples_per_s"] > 0 for r in rows)
