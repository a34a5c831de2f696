"""`varpack sft --objective dpo`: preference pairs from a file, the packing report, pairs kept whole in packs, the
first step's loss ln 2 (the reference is a copy of the starting policy), overlong pairs as units."""

from __future__ import annotations

import json
import math

import pytest

from varpack.cli.main import main


def _pairs_file(tmp_path, long_answer=None):
    topics = ["lists", "tuples", "sets", "dicts", "loops", "functions"]
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Explain Python {t} in one sentence."}],
            "chosen": [{"role": "assistant", "content": f"Python {t} are a core part of the language."}],
            "rejected": [{"role": "assistant", "content": f"I do not know about {t}. " * (1 + i % 3)}],
        }
        for i, t in enumerate(topics)
    ]
    if long_answer:
        rows[2]["rejected"][0]["content"] = long_answer
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_cli_dpo_on_a_file(tmp_path, capsys):
    data = _pairs_file(tmp_path)
    code = main(
        ["sft", "--objective", "dpo", "--data", str(data), "--packing-length", "160", "--max-steps", "2",
         "--beta", "0.2", "--no-save", "--output-dir", str(tmp_path / "out")]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(6 preference pairs, each in one pack)" in out and "samples   12" in out
    assert "loss dpo sigmoid, beta 0.2, reference: a frozen copy of the start" in out
    # DPO's own defaults (TRL's 1e-6 for loaded weights), not SFT's, on both sides of the line
    assert "peak lr 0.0001 (default for a random-init model; pretrained: 1e-06)" in out
    assert f"done: 2 steps, loss {math.log(2):.4f} ->" in out  # policy == reference at the first step


def test_build_dpo_packs_whole_pairs_and_first_loss_is_ln2(tmp_path):
    from varpack.train.config import SFTConfig
    from varpack.train.sft import build_sft

    data = _pairs_file(tmp_path)
    run = build_sft(
        SFTConfig(objective="dpo", data=(str(data),), packing_length=160, max_steps=1, save=False,
                  output_dir=str(tmp_path / "o"))
    )  # fmt: skip
    seen = []
    for pack in run.dataset:
        ids = [s["sample_id"] for s in pack]
        assert ids[0::2] == [i for i in ids[0::2] if i % 2 == 0] and ids[1::2] == [i + 1 for i in ids[0::2]]
        seen += ids
    assert sorted(seen) == list(range(12))
    batch = run.trainer.data_collator([run.dataset[0]])
    loss = run.trainer.objective.loss(run.model, batch).loss
    assert abs(float(loss.detach()) - math.log(2)) < 1e-6


def test_overlong_pair_dropped_and_reported(tmp_path, capsys):
    data = _pairs_file(tmp_path, long_answer="word " * 300)
    args = ["sft", "--objective", "dpo", "--data", str(data), "--packing-length", "160", "--max-steps", "1",
            "--no-save", "--output-dir", str(tmp_path / "o")]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "1 pair(s) are longer than --packing-length 160 together (pair id: tokens): 2: 347" in err
    assert main([*args, "--overflow", "drop"]) == 0
    assert "1 overlong pair(s) of 2 samples (dropped; pair ids 2)" in capsys.readouterr().out
    for policy in ("split", "truncate"):  # refused with the settings, before the data is read (usage error)
        assert main([*args, "--overflow", policy]) == 2
        err = capsys.readouterr().err
        assert f"--overflow {policy} cannot be used with --objective dpo: a preference pair stays whole" in err


@pytest.mark.parametrize("policy", ["truncate", "split"])
def test_dpo_cutting_overflow_refused_by_the_config(policy):
    """objective='dpo' with a policy that cuts samples: refused when the config is built, not at planning
    after minutes of encoding."""
    from varpack.train.config import SFTConfig

    with pytest.raises(ValueError, match=rf"SFTConfig\.overflow='{policy}' cannot be used with objective='dpo'"):
        SFTConfig(objective="dpo", overflow=policy)
    assert SFTConfig(objective="dpo", overflow="drop").overflow == "drop"
    assert SFTConfig(overflow=policy).overflow == policy  # SFT cuts samples as asked


def test_dpo_settings_refused(tmp_path, capsys):
    assert main(["sft", "--objective", "dpo", "--label-smoothing", "0.1", "--max-steps", "1"]) == 2
    assert "has no effect on --loss-type sigmoid" in capsys.readouterr().err
    assert main(["sft", "--objective", "dpo", "--loss-impl", "linear_ce", "--max-steps", "1"]) == 1
    assert "does not apply to --objective dpo: it reads the log-probabilities" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [{"prompt": "q", "chosen": "a"}])
def test_bad_pair_named(tmp_path, capsys, bad):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps(bad))
    assert main(["sft", "--objective", "dpo", "--data", str(path), "--max-steps", "1", "--no-save"]) == 1
    assert f"{path}:2: pair 1: field 'rejected' is missing" in capsys.readouterr().err
