"""benchmarks/collate.py --small: varpack's collator and transformers' give the same row (checked before
timing), for samples stored as lists, numpy arrays and a ``datasets.Dataset``."""

from __future__ import annotations

import json

from benchmarks.collate import main


def test_small_run_every_storage(tmp_path):
    out = tmp_path / "collate.json"
    assert main(["--small", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["storage"] for r in rows] == ["lists", "numpy", "datasets"]
    assert all(r["ratio"] > 0 and r["tokens_per_batch"] > 0 for r in rows)
