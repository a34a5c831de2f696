"""benchmarks/planner.py --small: varpack's BFD and the per-item segment-tree BFD give the same packs; every
file's plan within 0.5% of the lower bound."""

from __future__ import annotations

import json

from benchmarks.planner import main


def test_small_run_same_packs(tmp_path):
    out = tmp_path / "planner.json"
    assert main(["--small", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    tree = next(r for r in data["rows"] if r["method"].startswith("segment-tree"))
    assert "same packs as varpack: yes" in tree["note"] and tree["vs_varpack_bfd"] > 0
    assert all(f[-1] == "yes" for f in data["files"])
    assert {r["method"] for r in data["rows"]} >= {"varpack bfd", "varpack sequential (next-fit)"}
