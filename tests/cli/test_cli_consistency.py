"""One CLI convention for every sub-command.

* Building the parsers, ``--help`` and argument errors import no torch / transformers / datasets.
* Exit codes: 2 for usage errors (argparse, with the usage line), 1 for errors found while running
  (``varpack <command>: error: ...`` on stderr, no traceback), the same wording in every sub-command.
* Errors raised by the library name the CLI's flags when they reach the command line.
* One packing-length default for ``plan`` and ``sft``; every default shown once in ``--help``.
* ``sft`` / ``demo`` without saving leave no empty output folder; the learning-rate default depends on the
  kind of model (random-init built-in or loaded weights), and ``--help`` and the run's report say so.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from varpack.cli._common import ATTN_BACKENDS, flag_wording
from varpack.cli.main import build_parser, main

COMMANDS = ("plan", "sft", "check", "demo")
REPO = Path(__file__).resolve().parents[2]  # tests/cli/ -> the repository root


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _chat_rows(n: int, long_id: int | None = None) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": ("ok " * (400 if i == long_id else 3)).strip()},
            ]
        }
        for i in range(n)
    ]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------------
# item 8: parsers, --help and argument errors without torch
# ------------------------------------------------------------------------------------------------------
def test_parsers_help_and_argument_errors_import_no_torch(tmp_path):
    """In a fresh interpreter: build every parser, print every --help, and hit a usage error and a missing
    data file in each sub-command; torch, transformers and datasets must stay unimported."""
    missing = str(tmp_path / "missing.jsonl")
    script = textwrap.dedent(
        f"""
        import contextlib, io, json, sys
        from varpack.cli.main import build_parser, main

        build_parser().format_help()
        codes = {{}}
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for argv in (["--help"], ["plan", "--help"], ["sft", "--help"], ["check", "--help"],
                         ["demo", "--help"], ["plan", "--packing-length", "0"], ["sft", "--packing-length", "0"],
                         ["demo", "--packing-length", "-1"], ["check", "--num-samples", "0"],
                         ["sft", "--attn-backend", "nope"], ["plan", {missing!r}], ["sft", "--data", {missing!r}],
                         ["check", "--data", {missing!r}], ["demo", "--data", {missing!r}]):
                codes[" ".join(argv)] = main(argv)
        heavy = [m for m in ("torch", "transformers", "datasets") if m in sys.modules]
        print(json.dumps({{"codes": codes, "heavy": heavy}}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300, check=True
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["heavy"] == [], out
    codes = out["codes"]
    assert [codes[k] for k in codes if k.endswith("--help")] == [0] * 5
    assert {k: v for k, v in codes.items() if "missing" in k} == {k: 1 for k in codes if "missing" in k}, (
        codes
    )
    assert {k: v for k, v in codes.items() if "help" not in k and "missing" not in k} == {
        k: 2 for k in codes if "help" not in k and "missing" not in k
    }, codes


def test_attn_backend_choices_are_the_registry():
    from varpack.attn import BACKENDS

    assert sorted(ATTN_BACKENDS) == sorted(["auto", *BACKENDS])


def test_gated_delta_backend_choices_are_the_dispatch_backends():
    """--gated-delta-backend of check and sft offers exactly 'auto' and dispatch.BACKENDS."""
    from varpack.cli._common import GATED_DELTA_BACKENDS
    from varpack.ops.gated_delta_rule.dispatch import BACKENDS

    assert GATED_DELTA_BACKENDS == ("auto", *BACKENDS)
    for cmd in ("check", "sft"):
        actions = _subparsers()[cmd]._actions
        (action,) = [a for a in actions if a.dest == "gated_delta_backend" and a.help != argparse.SUPPRESS]
        assert tuple(action.choices) == GATED_DELTA_BACKENDS and action.default == "auto", cmd


@pytest.mark.parametrize("cmd", ["plan", "sft", "demo"])
def test_packing_strategy_choices_are_the_strategy_table(cmd):
    """--packing-strategy offers exactly the names of varpack.plan's STRATEGY_TABLE, each with its summary."""
    from varpack.plan import STRATEGY_TABLE

    actions = [a for a in _subparsers()[cmd]._actions if a.dest == "packing_strategy"]
    (action,) = [a for a in actions if a.help != argparse.SUPPRESS]  # the hidden --packing_strategy aside
    assert tuple(action.choices) == tuple(STRATEGY_TABLE)
    for name, strategy in STRATEGY_TABLE.items():
        assert f"{name}: {strategy.summary}" in action.help


# ------------------------------------------------------------------------------------------------------
# item 10: exit codes and wording
# ------------------------------------------------------------------------------------------------------
def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "many"])
def test_nonpositive_packing_length_is_one_usage_error_everywhere(value, capsys):
    """plan, sft and demo refuse a bad --packing-length with the same line and exit code 2 (argparse);
    check's --num-samples, the same kind of flag, with the same wording."""
    lines = {}
    for cmd, flag in (
        ("plan", "--packing-length"),
        ("sft", "--packing-length"),
        ("demo", "--packing-length"),
        ("check", "--num-samples"),
    ):
        code, out, err = _run([cmd, flag, value], capsys)
        assert code == 2 and out == "" and "Traceback" not in err, (cmd, err)
        assert err.startswith(f"usage: varpack {cmd}"), err
        last = err.strip().splitlines()[-1]
        assert last == f"varpack {cmd}: error: argument {flag}: must be an integer >= 1, got {value!r}", last
        lines[cmd] = last.split(": error: ", 1)[1].replace(flag, "FLAG")
    assert len(set(lines.values())) == 1, lines


@pytest.mark.parametrize("cmd", COMMANDS)
def test_usage_errors_exit_2(cmd, capsys):
    for argv in ([cmd, "--no-such-flag"], [cmd, "--overflow" if cmd != "check" else "--dtype", "nope"]):
        code, out, err = _run(argv, capsys)
        assert code == 2 and f"varpack {cmd}: error: " in err and "Traceback" not in err, err


@pytest.mark.parametrize("cmd", COMMANDS)
def test_abbreviated_flags_are_not_taken(cmd, capsys):
    """argparse took any unique prefix of a long flag (``--packing-len 4096`` set --packing-length): a typo of
    one flag silently became another. Every long flag of every sub-command, cut by one character where that is
    not a flag itself, is now an unrecognized argument."""
    parser = build_parser()
    sp = _subparsers()[cmd]
    flags = {o for a in sp._actions for o in a.option_strings if o.startswith("--")}
    cut = sorted({f[:-1] for f in flags if len(f) > 4} - flags)
    assert len(cut) > 5
    for prefix in cut:
        _, extra = parser.parse_known_args([cmd, prefix, "1"] if cmd != "plan" else [cmd, prefix])
        assert prefix in extra, (cmd, prefix, extra)
    code, out, err = _run([cmd, "--pack" if cmd != "check" else "--num-samp", "4096"], capsys)
    flag = "--pack" if cmd != "check" else "--num-samp"
    named = flag if cmd == "plan" else f"{flag} 4096"  # plan takes 4096 as a DATA path
    assert code == 2 and out == "" and err.strip().splitlines()[-1].startswith(
        f"varpack {cmd}: error: unrecognized arguments: {named}"
    ), err
    if cmd == "sft":  # an abbreviation of several flags names them all, not the always-on --packing alone
        assert "(did you mean one of --packing, --packing-length, --packing-strategy, --packs-per-step" in err, err
        # one flag it starts: that flag, not the nearest spelling (--packs read as --packing, --extra as --beta);
        # a setting with an alias is named once
        for typed, said in [
            ("--packs", "(did you mean --packs-per-step?)"),
            ("--extra", "(did you mean --extra-training-args?)"),
            ("--warmup", "(did you mean --warmup-steps?)"),
            ("--grad", "(did you mean one of --grad-accum, --gradient-checkpointing?)"),
        ]:
            code, _, err = _run([cmd, typed, "2"], capsys)
            assert code == 2 and err.rstrip().endswith(said), err


@pytest.mark.parametrize("cmd", COMMANDS)
def test_underscore_spellings_are_the_same_flags(cmd, capsys):
    """Every sub-command takes ``--under_score`` for its ``--under-score`` flags (as TRL / HF scripts spell
    them), ``=value`` included; a word after ``--``, a value with an underscore and an underscore spelling of
    no flag are left as they are."""
    from varpack.cli.main import hyphen_spellings

    sp = _subparsers()[cmd]
    flags = {o for a in sp._actions for o in a.option_strings if o.startswith("--")}
    hyphenated = sorted(f for f in flags if "-" in f[2:])
    assert hyphenated
    for flag in hyphenated:
        under = "--" + flag[2:].replace("-", "_")
        want = flag if under not in flags else under  # sft also declares the underscore spelling itself
        assert hyphen_spellings([cmd, under, "x_y"], sp) == [cmd, want, "x_y"], flag
        assert hyphen_spellings([cmd, under + "=a_b"], sp) == [cmd, want + "=a_b"], flag
    assert hyphen_spellings([cmd, "--", "--packing_length"], sp)[-1] == "--packing_length"
    assert hyphen_spellings([cmd, "--no_such_flag"], sp) == [cmd, "--no_such_flag"]
    code, _, err = _run([cmd, "--no_such_flag"], capsys)
    assert code == 2 and "unrecognized arguments: --no_such_flag" in err


def test_underscore_spelling_parses_as_the_hyphen_flag():
    from varpack.cli.main import _sub_parser, hyphen_spellings

    parser = build_parser()
    for argv in (["plan", "--packing_length", "512", "d.jsonl"], ["plan", "--packing_length=512", "d.jsonl"]):
        args = parser.parse_args(hyphen_spellings(argv, _sub_parser(parser, argv)))
        assert args.packing_length == 512 and args.data == ["d.jsonl"]
    # negative control: without the rewrite, plan does not know the underscore spelling
    _, extra = parser.parse_known_args(["plan", "--packing_length", "512", "d.jsonl"])
    assert "--packing_length" in extra


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["plan", "--packing-lenght", "256", "d.jsonl"], "did you mean --packing-length?"),
        (["sft", "--modle", "tiny-qwen3"], "did you mean --model?"),
        (["check", "--num-samples=3", "--dtpye", "bf16"], "did you mean --dtype?"),
    ],
)
def test_unrecognized_flag_names_the_closest(argv, hint, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "" and err.strip().splitlines()[-1].endswith(f"({hint})"), err


@pytest.mark.parametrize("argv", [["sft", "--packinglength", "256"], ["demo", "--maxsteps", "2"], ["sft", "--nosave"]])
def test_the_guess_is_the_hyphen_spelling(argv, capsys):
    """sft / demo also declare each flag's underscore spelling: the guess names the hyphen flag of the usage line."""
    code, _, err = _run(argv, capsys)
    guess = err.strip().splitlines()[-1].rsplit("(did you mean ", 1)[1]
    assert code == 2 and "_" not in guess, err


def test_each_unrecognized_flag_gets_its_guess(capsys):
    code, _, err = _run(["sft", "--packing-lenght", "10", "--max-step", "3", "--zzzzzz"], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.endswith("(did you mean --packing-length for --packing-lenght, --max-steps for --max-step?)")


@pytest.mark.parametrize(
    "argv, flag, moved",
    [
        (["--packing-length", "10", "sft"], "--packing-length", "varpack sft --packing-length 10)"),
        (["--json", "plan", "d.jsonl"], "--json", "varpack plan --json d.jsonl)"),
        (["--max-steps", "1", "sft", "--model", "tiny-qwen3", "--no-save", "--bf16"], "--max-steps",
         "varpack sft --max-steps 1 --model tiny-qwen3 --no-save ...)"),
    ],
)  # fmt: skip
def test_a_flag_before_the_command_names_the_order_that_works(argv, flag, moved, capsys):
    """argparse took the flag's value for the command ("invalid choice: '10'"): the error names the flag and the
    command line with the flag moved after the command."""
    code, out, err = _run(argv, capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and out == "" and last.startswith(f"varpack: error: {flag} comes before the command "), err
    assert last.endswith(moved) and "invalid choice" not in err, last
    # the control: -h before the command is the top-level help, and "--" ends the check
    assert _run(["-h", "sft"], capsys)[0] == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "m", "plan"], "--model comes before the command 'plan', and plan has no --model flag"),
        (["--pack", "10", "sft"], "--pack comes before the command 'sft', and sft has no --pack flag (did you mean"),
        (["--packing-length", "10"], "--packing-length needs a command before it: varpack COMMAND --packing-length"),
    ],
)
def test_a_flag_before_the_command_that_moving_would_not_fix(argv, message, capsys):
    """A flag the command does not have is not suggested after it (that would fail too); with no command, the
    commands are named (was "invalid choice: '10'")."""
    code, _, err = _run(argv, capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"varpack: error: {message}") and "invalid choice" not in err, last


@pytest.mark.parametrize("word, guess", [("spt", "sft"), ("Plan", "plan"), ("chekc", "check"), ("zzz", None)])
def test_a_misspelled_command_gets_its_guess(word, guess, capsys):
    code, _, err = _run([word, "--max-steps", "1"], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"varpack: error: unknown command {word!r}"), last
    assert (f"(did you mean {guess}?)" in last) if guess else ("did you mean" not in last), last
    assert last.endswith("the commands: plan, sft, check, demo")


def test_help_before_the_command_is_the_commands_help(capsys):
    code, out, _ = _run(["--help", "sft"], capsys)
    assert code == 0 and out.startswith("usage: varpack sft")
    code, out, _ = _run(["--help"], capsys)  # the control: alone, the top-level help
    assert code == 0 and out.startswith("usage: varpack [-h] COMMAND")


def test_no_guess_for_words_after_the_double_dash(capsys):
    code, _, err = _run(["sft", "--", "--packing_length", "256"], capsys)
    assert code == 2 and "did you mean" not in err and "unrecognized arguments: -- --packing_length 256" in err
    # negative control: the same word before "--" gets its guess
    code, _, err = _run(["sft", "--packing_lenght", "256"], capsys)
    assert code == 2 and "(did you mean --packing-length?)" in err


def test_unrecognized_flag_far_from_every_flag_gets_no_guess(capsys):
    code, _, err = _run(["sft", "--zzzzzz"], capsys)
    assert code == 2 and err.strip().endswith("unrecognized arguments: --zzzzzz")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_missing_data_file_exits_1_with_one_error_line(cmd, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    argv = [cmd, str(missing)] if cmd == "plan" else [cmd, "--data", str(missing)]
    code, out, err = _run(argv, capsys)
    assert code == 1 and out == "", err
    assert err == f"varpack {cmd}: error: chat data file not found: {str(missing)!r}\n"


@pytest.mark.parametrize("cmd", COMMANDS)
def test_data_directory_exits_1_naming_the_path(cmd, tmp_path, capsys):
    """A directory as data was reported as "chat data file not found" (it exists); varpack reads the files it
    is given, and the error says which ones the directory holds."""
    folder = tmp_path / "chats"
    folder.mkdir()
    _write(folder / "a.jsonl", _chat_rows(2))
    _write(folder / "b.jsonl", _chat_rows(2))
    argv = [cmd, str(folder)] if cmd == "plan" else [cmd, "--data", str(folder)]
    code, out, err = _run(argv, capsys)
    assert code == 1 and out == "" and "Traceback" not in err, err
    want = (
        f"varpack {cmd}: error: chat data path {str(folder)!r} is a directory, not a file: give the data files "
        f"in it (e.g. {folder / '*.jsonl'}; it holds 2 .jsonl files)\n"
    )
    assert err == want, err


def test_data_directory_is_refused_by_every_reader(tmp_path):
    from varpack.data.chat import load_chat_data
    from varpack.data.multimodal import load_mm_rows
    from varpack.data.preference import load_pairs
    from varpack.data.stream import ChatStream

    folder = tmp_path / "empty"
    folder.mkdir()
    for read in (load_chat_data, load_mm_rows, load_pairs, ChatStream):
        with pytest.raises(IsADirectoryError, match=r"is a directory, not a file: .*it holds no \.json"):
            read(str(folder))


@pytest.mark.parametrize("cmd", COMMANDS)
def test_bad_data_row_exits_1_naming_the_sample(cmd, tmp_path, capsys):
    """A data error found while running (a row without messages) is exit 1, one line, no traceback, in every
    sub-command (check used to exit 2)."""
    path = tmp_path / "bad.jsonl"
    _write(path, [*_chat_rows(3), {"text": "no messages here"}])
    argv = {
        "plan": ["plan", str(path)],
        "sft": ["sft", "--data", str(path), "--max-steps", "1", "--no-save"],
        "check": ["check", "--data", str(path)],
        "demo": ["demo", "--data", str(path), "--max-steps", "1"],
    }[cmd]
    code, out, err = _run(argv, capsys)
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"varpack {cmd}: error: ") and "messages" in lines[-1], err


def test_check_without_cuda_is_a_run_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = _run(["check", "--device", "cuda"], capsys)
    assert code == 1 and err == "varpack check: error: --device cuda but CUDA is not available here\n"
    code, out, err = _run(["check", "--device", "gpu0"], capsys)
    assert code == 1 and err.startswith("varpack check: error: --device 'gpu0' is not a device"), err


@pytest.mark.parametrize("cmd", ["plan", "sft"])
def test_overflow_error_names_the_cli_flags(cmd, tmp_path, capsys):
    """The overlong-sample error reached through the CLI names --overflow / --packing-length, not the Python
    arguments (which the library error keeps: see test_library_overflow_error_names_python_arguments)."""
    path = _write(tmp_path / "long.jsonl", _chat_rows(4, long_id=2))
    argv = (
        [cmd, str(path), "--packing-length", "256"]
        if cmd == "plan"
        else [cmd, "--data", str(path), "--packing-length", "256", "--max-steps", "1", "--no-save"]
    )
    code, out, err = _run(argv, capsys)
    assert code == 1 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"varpack {cmd}: error: 1 sample(s) are longer than --packing-length 256"), line
    assert "--overflow drop, --overflow truncate or --overflow split" in line, line
    assert "overflow=" not in line and "packing_length" not in line, line


def test_no_pack_error_names_the_cli_flags(tmp_path, capsys):
    path = _write(tmp_path / "long.jsonl", _chat_rows(2, long_id=0)[:1])
    argv = ["sft", "--data", str(path), "--packing-length", "64", "--overflow", "drop", "--no-save"]
    code, out, err = _run(argv, capsys)
    line = err.strip().splitlines()[-1]
    assert code == 1 and line.startswith("varpack sft: error: no pack to train on"), err
    assert "raise --packing-length 64 or use --overflow split or --overflow truncate" in line, line


def test_library_overflow_error_names_python_arguments():
    from varpack.plan import plan_packs

    with pytest.raises(ValueError) as info:
        plan_packs([3, 9], 4)
    assert "packing_length=4" in str(info.value) and "overflow='drop'" in str(info.value)


def test_flag_wording_rewrites_only_this_commands_flags():
    sft = _subparsers()["sft"]
    assert flag_wording("raise packing_length=64 or use overflow='split'", sft) == (
        "raise --packing-length 64 or use --overflow split"
    )
    assert (
        flag_wording("SFTConfig.grad_accum has an invalid value: 0", sft)
        == "--grad-accum has an invalid value: 0"
    )
    assert flag_wording("use_liger_kernel needs a CUDA GPU", sft) == "--use-liger-kernel needs a CUDA GPU"
    # prose words that are flags without an underscore, and names that are not flags, stay
    text = "the model's seed; sample_id 3; reduction='sample'; --packing-length 5"
    assert flag_wording(text, sft) == text
    plan = _subparsers()["plan"]  # plan has no --grad-accum: nothing to rename
    assert flag_wording("grad_accum=2", plan) == "grad_accum=2"


def test_flag_wording_names_a_flag_once():
    """A library message that names a setting and its flag (``torch_compile (--torch-compile; ...)``) reads
    ``--torch-compile (...)`` on the command line, not ``--torch-compile (--torch-compile; ...)``."""
    from varpack.integrations.kernels import LIGER_COMPILE_REFUSAL

    sft = _subparsers()["sft"]
    text = flag_wording(LIGER_COMPILE_REFUSAL, sft)
    assert "Choose one: --torch-compile (inductor fuses" in text, text
    assert text.endswith("or --use-liger-kernel"), text
    assert text.count("--torch-compile") == 1 and text.count("--use-liger-kernel") == 1, text
    assert flag_wording("grad_accum (--grad-accum) and seed", sft) == "--grad-accum and seed"
    # a flag in parentheses after another flag stays
    assert flag_wording("grad_accum (--packs-per-step; x)", sft) == "--grad-accum (--packs-per-step; x)"
    # a setting as flag then field (varpack.train.config.setting_text) stays; a field after another flag not
    text = "--packs-per-step 2 (packs_per_step=2) and --torch-compile false (torch_compile=False)"
    assert flag_wording(text, sft) == text
    assert flag_wording("--lora (grad_accum=2)", sft) == "--lora (--grad-accum 2)"


DTYPE_SPELLINGS = [
    ("bf16", "bfloat16", "bf16"),
    ("bfloat16", "bfloat16", "bf16"),
    ("fp16", "float16", "fp16"),
    ("float16", "float16", "fp16"),
    ("fp32", "float32", "fp32"),
    ("float32", "float32", "fp32"),
]


@pytest.mark.parametrize(("given", "torch_name", "short"), DTYPE_SPELLINGS)
def test_dtype_takes_both_spellings_in_sft_and_check(given, torch_name, short, tmp_path):
    """``sft --dtype`` took float32 / bfloat16 / float16 and ``check --dtype`` bf16 / fp16 / fp32 (a fresh user's
    review): each takes both; sft keeps torch's names in its config, check its short ones; a --config file too."""
    from varpack.train.cli_flags import config_from_args
    from varpack.train.config import SFTConfig

    parser = build_parser()
    assert config_from_args(parser.parse_args(["sft", "--dtype", given])).dtype == torch_name
    assert config_from_args(parser.parse_args(["demo", "--dtype", given.upper()])).dtype == torch_name
    assert parser.parse_args(["check", "--dtype", given]).dtype == short
    assert SFTConfig(dtype=given).dtype == torch_name
    path = tmp_path / "run.yaml"
    path.write_text(f"dtype: {given}\n")
    assert config_from_args(parser.parse_args(["sft", "--config", str(path)])).dtype == torch_name


def test_dtype_help_defaults_and_errors_keep_each_commands_spelling(capsys):
    subs = _subparsers()
    assert subs["sft"].parse_args([]).dtype == "float32" and subs["check"].parse_args([]).dtype == "fp32"
    sft, check = _help_of(subs["sft"]), _help_of(subs["check"])
    assert "--dtype {float32,bfloat16,float16} parameter dtype of the model; also bf16, fp16, fp32" in sft
    assert "(default: float32)" in sft
    assert "--dtype {bf16,fp16,fp32} dtype of the run; also float32, bfloat16, float16" in check, check
    assert "(default: fp32)" in check
    for cmd, shown in (("sft", "'float32', 'bfloat16', 'float16'"), ("check", "'bf16', 'fp16', 'fp32'")):
        code, out, err = _run([cmd, "--dtype", "bf32"], capsys)
        assert code == 2 and out == "", err
        expected = f"varpack {cmd}: error: argument --dtype: invalid choice: 'bf32' (choose from {shown})"
        assert expected in err, err


# ------------------------------------------------------------------------------------------------------
# item 10: defaults in --help
# ------------------------------------------------------------------------------------------------------
def _help_of(parser: argparse.ArgumentParser) -> str:
    return re.sub(r"\s+", " ", parser.format_help())


def test_one_packing_length_default_shown_in_help():
    from varpack.plan import DEFAULT_PACKING_LENGTH
    from varpack.train.config import SFTConfig

    subs = _subparsers()
    plan_default = subs["plan"].get_default("packing_length")
    sft_default = subs["sft"].get_default("packing_length")
    assert plan_default == sft_default == SFTConfig().packing_length == DEFAULT_PACKING_LENGTH == 4096
    for cmd in ("plan", "sft"):
        assert f"--packing-length N tokens per pack (default: {DEFAULT_PACKING_LENGTH})" in _help_of(
            subs[cmd]
        )
    from varpack.cli.demo import DEMO_DEFAULTS

    assert subs["demo"].get_default("packing_length") == DEMO_DEFAULTS["packing_length"]
    assert f"tokens per pack (default: {DEMO_DEFAULTS['packing_length']})" in _help_of(subs["demo"])


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_default_shown_once(cmd):
    """Each option with a default worth showing says "(default: ...)" exactly once; none shows None/True/False."""
    parser = _subparsers()[cmd]
    for action in parser._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        n = action.help.count("(default:")
        assert n <= 1, (cmd, action.option_strings, action.help)
        shown = action.default not in (None, False, True, argparse.SUPPRESS)
        if shown and action.nargs != 0:
            assert n == 1, (cmd, action.option_strings, action.help)
    text = _help_of(parser)
    for bad in ("(default: None)", "(default: True)", "(default: False)"):
        assert bad not in text, (cmd, bad)


# ------------------------------------------------------------------------------------------------------
# item 10: no empty output folder; item 12: learning rate per model kind
# ------------------------------------------------------------------------------------------------------
VOCAB = 512


class _Tok:
    """The tokenizer attributes run_sft needs when the samples come pre-encoded."""

    pad_token_id = 0

    def save_pretrained(self, path):
        Path(path, "tokenizer.json").write_text("{}")


def _samples(n=8):
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = 5 + (7 * i) % 20
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100, *ids[1:]], "length": length})
    return out


def _run_sft(tmp_path, **cfg):
    from varpack.models import load_model
    from varpack.train import SFTConfig, run_sft

    kw = dict(
        output_dir=str(tmp_path / "out"),
        packing_length=32,
        attn_backend="reference",
        max_steps=1,
        extra_training_args={"use_cpu": True},
    )
    kw.update(cfg)
    printed: list[str] = []
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    run = run_sft(SFTConfig(**kw), print_fn=printed.append, model=model, tokenizer=_Tok(), encoded=_samples())
    return run, "\n".join(printed)


def test_no_save_leaves_no_empty_output_dir(tmp_path):
    """Trainer creates output_dir; a run that saves nothing removes it again (what `make demo` left behind).
    Controls: with saving it holds the model; a folder that existed before is left alone."""
    out = tmp_path / "out"
    _run_sft(tmp_path, save=False)
    assert not out.exists()
    _run_sft(tmp_path, save=True)
    assert out.is_dir() and any(out.iterdir())
    existing = tmp_path / "mine"
    existing.mkdir()
    _run_sft(tmp_path, save=False, output_dir=str(existing))
    assert existing.is_dir()


def test_default_lr_depends_on_model_kind(tmp_path):
    from varpack.train.config import DEFAULT_LR, default_lr

    assert DEFAULT_LR == {"random-init": 3e-3, "pretrained": 1e-4}
    assert default_lr("tiny-qwen3") == (3e-3, "random-init")
    assert default_lr("tiny-llama") == (3e-3, "random-init")
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert default_lr(str(model_dir)) == (1e-4, "pretrained")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert default_lr(str(gguf)) == (1e-4, "pretrained")
    with pytest.raises(ValueError, match="no-such-model"):
        default_lr("no-such-model")
    # DPO: TRL's DPOConfig default for loaded weights, 1e-4 for random init (3e-3 made the loss rise)
    assert default_lr("tiny-qwen3", "dpo") == (1e-4, "random-init")
    assert default_lr(str(model_dir), "dpo") == (1e-6, "pretrained")


def test_dpo_run_uses_the_dpo_default_lr(tmp_path):
    from varpack.train import SFTConfig
    from varpack.train.sft import build_sft

    run = build_sft(SFTConfig(model="tiny-qwen3", objective="dpo", packing_length=1024, max_steps=1, save=False,
                              output_dir=str(tmp_path / "o")))  # fmt: skip
    assert run.config.lr == 1e-4 and run.lr_default_kind == "random-init"


def test_run_uses_and_reports_the_lr(tmp_path):
    """The Trainer gets the per-kind default (its optimizer's lr is checked, not only the config), the report
    names it and why; a set lr is kept and reported as set."""
    run, report = _run_sft(tmp_path, save=False)
    assert run.config.lr == 3e-3 and run.lr_default_kind == "random-init"
    assert run.trainer.args.learning_rate == 3e-3
    assert run.trainer.optimizer.param_groups[0]["initial_lr"] == 3e-3
    assert "peak lr 0.003 (default for a random-init model; pretrained: 0.0001)" in report, report
    run, report = _run_sft(tmp_path, save=False, lr=5e-4)
    assert run.config.lr == 5e-4 and run.lr_default_kind is None
    assert run.trainer.optimizer.param_groups[0]["initial_lr"] == 5e-4
    assert "peak lr 0.0005 (set)" in report, report


def test_lr_default_in_help():
    subs = _subparsers()
    assert subs["sft"].get_default("lr") is None
    assert (
        "(default: 0.003 for a random-init built-in model, 0.0001 for a model directory or GGUF file; with "
        "--objective dpo 0.0001 and 1e-06)"
    ) in _help_of(subs["sft"])
    assert "peak learning rate (AdamW) (default: 0.003)" in _help_of(subs["demo"])
