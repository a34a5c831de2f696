"""benchmarks/train.py under a wall-clock limit (``--time-budget``): configurations not started in time are
skipped with a row that says so, and ``--out`` holds every finished row after each configuration."""

from __future__ import annotations

import json

from benchmarks import train as T


def test_budget_with_a_fake_clock():
    now = [100.0]
    b = T.Budget(10.0, clock=lambda: now[0])
    assert not b.spent()
    now[0] = 109.9
    assert not b.spent()
    now[0] = 110.0
    assert b.spent() and "--time-budget 10 s" in b.reason()
    assert not T.Budget(None, clock=lambda: 1e9).spent()  # no budget: never spent


def test_spent_budget_skips_every_config_and_still_writes_the_table(tmp_path, capsys):
    out = tmp_path / "train.json"
    rc = T.main(
        ["--small", "--device", "cpu", "--configs", "hf_sdpa,varpack_lce", "--rounds", "2",
         "--time-budget", "0", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["partial"] is False
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"hf_sdpa", "varpack_lce"}  # no hf_sdpa fallback run after the budget is spent
    for r in rows.values():
        assert "real_tokens_per_s" not in r
        assert all(x["error"].startswith("skipped: --time-budget 0 s") for x in r["rounds"])
    assert "(after round 1)" in capsys.readouterr().out


def test_finished_rows_are_written_before_the_end(tmp_path, monkeypatch):
    out = tmp_path / "train.json"
    seen = []
    real_run = T.run_config

    def run_and_look(config, *a, **k):
        if out.exists():  # what a wall-clock kill would leave at this point
            seen.append(
                [r["config"] for r in json.loads(out.read_text())["rows"] if "real_tokens_per_s" in r]
            )
        return real_run(config, *a, **k)

    monkeypatch.setattr(T, "run_config", run_and_look)
    argv = [
        "--small",
        "--device",
        "cpu",
        "--configs",
        "hf_sdpa,varpack_lce",
        "--rounds",
        "1",
        "--out",
        str(out),
    ]
    assert T.main(argv) == 0
    assert seen == [["hf_sdpa"]]  # before varpack_lce ran, hf_sdpa's finished row was on disk
    assert json.loads(out.read_text())["partial"] is False
