"""benchmarks/scaling.py --small: DDP over 2 CPU processes (gloo) under torchrun, and one process without it;
the table of the two runs with the scaling ratio."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.scaling import compare, main
from tests import _launch as launch

ROOT = Path(__file__).resolve().parents[2]


def test_small_runs_and_their_table(tmp_path, capsys):
    one, two = tmp_path / "w1.json", tmp_path / "w2.json"
    assert main(["--small", "--out", str(one)]) == 0  # no torchrun: a one-rank group of this process
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    cmd = launch.torchrun(2, "benchmarks/scaling.py", "--small", "--out", two)
    run = launch.run(cmd, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    w1, w2 = json.loads(one.read_text()), json.loads(two.read_text())
    assert (w1["world_size"], w1["engine"], w2["world_size"], w2["engine"]) == (1, "none", 2, "ddp")
    assert len(w2["ms_per_step_per_rank"]) == 2 and w2["tokens_per_s"] > 0
    table = compare([str(one), str(two)])
    assert "| tiny-qwen3 | ddp | 2 |" in table and table.splitlines()[0].endswith("vs 1 GPU |")
