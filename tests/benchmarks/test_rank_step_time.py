"""benchmarks/rank_step_time.py --small: both layouts timed on one rank (no torchrun), the measured and the
cost model's imbalance beside each other."""

from __future__ import annotations

import json

from benchmarks.rank_step_time import main


def test_small_run_one_rank(tmp_path):
    out = tmp_path / "rank.json"
    assert main(["--small", "--out", str(out)]) == 0
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"round-robin", "balanced"}
    for r in rows.values():  # one rank: nobody waits
        assert r["measured"] == 1.0 and r["model"] == 1.0 and r["slots"] == 4
