"""benchmarks/train.py under a wall-clock limit (``--time-budget``): configurations not started in time are
skipped with a row that says so, and ``--out`` holds every finished row after each configuration."""

from __future__ import annotations

import json

import pytest

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


def test_negative_or_nan_budget_is_refused(capsys):
    for bad in ("-3", "nan"):
        with pytest.raises(SystemExit) as exc:
            T.main(["--small", "--device", "cpu", "--configs", "hf_sdpa", "--time-budget", bad])
        assert exc.value.code == 2
        assert "--time-budget must be a number of seconds >= 0" in capsys.readouterr().err


def test_a_row_measured_in_one_round_of_two_says_which_round_is_missing(monkeypatch, capsys):
    """hf_sdpa runs in round 1, then the budget is spent: its row shows round 1's numbers and says that round 2
    was not measured (the footer says 2 rounds)."""

    class SpentAfterFirst(T.Budget):
        calls = 0

        def spent(self) -> bool:
            SpentAfterFirst.calls += 1
            return SpentAfterFirst.calls > 1

    monkeypatch.setattr(T, "Budget", SpentAfterFirst)
    rc = T.main(
        ["--small", "--device", "cpu", "--configs", "hf_sdpa,varpack_lce", "--rounds", "2", "--time-budget", "60"]
    )  # fmt: skip
    assert rc == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| hf_sdpa |")]
    row = rows[-1]  # the final table's
    assert "round 2 not measured (skipped: --time-budget 60 s spent before it started)" in row
    assert "1.00 (1.00)" in row  # round 1's ratio only


def test_goal_line_needs_every_round_and_exact_configs_only():
    rows = [
        {"config": "hf_fa4_liger", "real_tokens_per_s": 53000.0, "vs_best_peer_rounds": [1.0, 1.0], "mfu": 0.19},
        {
            "config": "varpack_lce_compile",
            "real_tokens_per_s": 81000.0,
            "vs_best_peer_rounds": [1.55, 1.49],
            "best_peer_rounds": ["hf_fa4_liger", "hf_fa4_liger"],
            "mfu": 0.41,
        },
        {"config": "varpack", "real_tokens_per_s": 50000.0, "vs_best_peer_rounds": [0.94, 0.95],
         "best_peer_rounds": ["hf_fa4_liger", "hf_fa4_liger"], "mfu": 0.2},
    ]  # fmt: skip
    line = T.goal_line(rows)
    assert "varpack_lce_compile" in line and "1.55 / 1.49x" in line
    assert "goal 1.5x: not met" in line  # round 2 fell short: not met
    assert "goal 40%: MET" in line
    rows[1]["vs_best_peer_rounds"] = [1.55, 1.52]
    assert "goal 1.5x: MET" in T.goal_line(rows)
    assert T.goal_line([rows[0]]) is None  # no varpack row
    assert T.goal_line([{"config": "varpack", "error": "skipped"}]) is None


def test_goal_line_not_met_when_a_round_failed():
    def row(config, tps):
        return {"config": config, "real_tokens_per_s": tps, "step_ms": 1.0, "supervised_tokens_per_s": tps,
                "mfu": 0.45, "cold_first_step_s": 1.0, "cold_pass_s": 1.0}  # fmt: skip

    first = [row("hf_fa4", 10000.0), row("varpack_lce_compile", 20000.0)]
    for second, mfu in (
        (
            [row("hf_fa4", 10000.0), {"config": "varpack_lce_compile", "error": "CUDA out of memory"}],
            "not met",
        ),
        ([{"config": "hf_fa4", "error": "CUDA out of memory"}, row("varpack_lce_compile", 20000.0)], "MET"),
    ):
        line = T.goal_line(T.add_ratios([first, second]))
        assert "no ratio in 1 of 2 rounds" in line
        assert "goal 1.5x: not met" in line and f"goal 40%: {mfu}" in line
    assert "goal 1.5x: MET" in T.goal_line(T.add_ratios([first, first]))
