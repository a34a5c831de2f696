"""benchmarks/context_parallel.py --small: the zigzag split balances the causal work the contiguous split does
not, and the activation memory of one rank is measured against the whole row."""

from __future__ import annotations

import json

from benchmarks.context_parallel import main


def test_small_work_table(tmp_path):
    out = tmp_path / "work.json"
    assert main(["work", "--small", "--out", str(out)]) == 0
    rows = {(r["mix"].startswith("long"), r["split"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 4 and all(r["N"] == 2 and abs(r["tokens"] - 1.0) < 1e-3 for r in rows.values())
    long_zigzag, long_contiguous = rows[(True, "zigzag")], rows[(True, "contiguous")]
    assert long_zigzag["attn"] < 1.01 < long_contiguous["attn"]  # the long documents' ends weigh on one rank
    assert long_zigzag["ring"] <= long_contiguous["ring"]


def test_small_memory_one_rank(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert main(["memory", "--small", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["tokens"] == 1024 and data["cp1_bytes"] > 0 and len(data["per_rank"]) == 1
    assert data["per_rank"][0]["tokens"] == 1024
    assert "cp=1 (one process, whole row)" in capsys.readouterr().out
