"""benchmarks/attention_host_time.py --small: varpack's host time per call with the batch's meta and with
offsets."""

from __future__ import annotations

import json

from benchmarks.attention_host_time import main


def test_small_run_times_both_calls(tmp_path):
    out = tmp_path / "host.json"
    assert main(["--small", "--out", str(out)]) == 0
    rows = {(r["backend"], r["call"]): r["us"] for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(b, c) for b in ("no_kernel", "sdpa") for c in ("meta", "tensors")}
    assert all(us > 0 for us in rows.values())
