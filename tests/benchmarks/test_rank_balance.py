"""benchmarks/rank_balance.py --small: the balanced layout's cost imbalance against round-robin's, same
packs."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.rank_balance import LAYOUTS, main


def test_small_run_balances(tmp_path):
    out = tmp_path / "balance.json"
    assert main(["--small", "--out", str(out)]) == 0
    mixes = json.loads(out.read_text())["mixes"]
    assert len(mixes) == 2
    for mix in mixes.values():
        rows = mix["rows"]
        assert [(r["ranks"], r["packs_per_rank"]) for r in rows] == [list(x) for x in LAYOUTS] or len(
            rows
        ) == len(LAYOUTS)
        assert all(r["balanced"] >= 1.0 and r["round_robin"] >= 1.0 for r in rows)
        assert np.mean([r["balanced"] for r in rows]) < np.mean([r["round_robin"] for r in rows])
