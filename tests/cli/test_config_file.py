"""`varpack sft --config FILE` (YAML / JSON), the resolved settings a saved run writes beside its model, and the
TRL / ms-swift spellings of the flags."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from varpack.cli.main import build_parser, main
from varpack.train.cli_flags import config_from_args, config_to_argv
from varpack.train.config import ALWAYS_ON, SFTConfig
from varpack.train.config_file import CONFIG_FILE_NAME, config_mapping, load_config_file, write_config_file
from varpack.train.fields import field_names, flag_name

FIELDS = [f.name for f in dataclasses.fields(SFTConfig)]
HINTS = typing.get_type_hints(SFTConfig)

#: a value for every field, none of them the default (the same as tests/test_train_config.py's)
NON_DEFAULT = dict(
    model="tiny-llama",
    data=("a.jsonl", "b.parquet"),
    output_dir="elsewhere",
    packing_length=77,
    packing_strategy="sequential",
    overflow="drop",  # not split: objective="dpo" below keeps pairs whole
    packs_per_step=3,
    grad_accum=2,
    epochs=2.5,
    max_steps=9,
    lr=5e-4,
    lr_scheduler="cosine",
    warmup_steps=4,
    weight_decay=0.1,
    loss_reduction="sample",
    loss_impl="logits",
    attn_backend="flex",
    gated_delta_backend="fla_hybrid",
    bf16=True,
    dtype="bfloat16",
    seed=7,
    logging_steps=3,
    num_proc=2,
    dataloader_num_workers=2,
    rank_balance=False,
    fsdp=True,
    context_parallel=2,
    context_parallel_attention="ring",
    attention_cost_weight=0.25,
    gradient_checkpointing=True,
    use_liger_kernel=True,
    torch_compile=True,
    cuda_graphs=True,
    save=False,
    report_to="tensorboard",
    extra_training_args={"max_grad_norm": 0.5, "optim": "sgd"},
    lora=True,
    lora_r=8,
    lora_alpha=16,
    lora_dropout=0.05,
    lora_target_modules="q_proj,v_proj",
    lora_merge=True,
    streaming=True,
    buffer_size=500,
    objective="dpo",
    beta=0.3,
    label_smoothing=0.1,
    loss_type="robust",
)


def _parse(*argv: str) -> SFTConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def _dump(path: Path, mapping: dict) -> Path:
    plain = {k: list(v) if isinstance(v, tuple) else v for k, v in mapping.items()}
    if path.suffix == ".json":
        path.write_text(json.dumps(plain))
    else:
        path.write_text(yaml.safe_dump(plain, sort_keys=False))
    return path


def _main_err(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------
# item 3: config files
# ------------------------------------------------------------------------------------------------------
def test_non_default_fixture_covers_every_field():
    assert set(NON_DEFAULT) == set(FIELDS)
    assert [n for n in FIELDS if getattr(SFTConfig(), n) == NON_DEFAULT[n]] == []


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
@pytest.mark.parametrize("spelling", ["snake", "kebab"])
def test_file_gives_the_config_the_flags_give(tmp_path, suffix, spelling):
    """A file with a non-default value of every field == the same values as flags == the dataclass."""
    direct = SFTConfig(**NON_DEFAULT)
    keyed = {(k if spelling == "snake" else k.replace("_", "-")): v for k, v in NON_DEFAULT.items()}
    path = _dump(tmp_path / f"run{suffix}", keyed)
    from_file = _parse("sft", "--config", str(path))
    from_flags = _parse("sft", *config_to_argv(direct))
    assert from_file == from_flags == direct


def test_yaml_numbers_as_yaml_1_1_reads_them(tmp_path):
    """PyYAML reads `lr: 3e-3` as the string '3e-3'; the file is checked as the flag is, so it is 0.003."""
    path = tmp_path / "run.yaml"
    path.write_text("lr: 3e-3\nweight_decay: 1e-2\nepochs: 2\n")
    assert yaml.safe_load(path.read_text())["lr"] == "3e-3"  # the reason for the rule
    c = _parse("sft", "--config", str(path))
    assert (c.lr, c.weight_decay, c.epochs) == (0.003, 0.01, 2.0)


def test_flags_given_override_the_file_in_any_order(tmp_path):
    """A flag given wins even when its value is the default (the file is not just 'non-defaults first');
    fields the command line does not give come from the file, the rest are the parser defaults."""
    path = _dump(tmp_path / "run.yaml", {"packing_length": 77, "bf16": True, "seed": 7, "data": ["x.jsonl"]})
    assert _parse("sft", "--config", str(path)) == SFTConfig(
        packing_length=77, bf16=True, seed=7, data="x.jsonl"
    )
    for argv in (
        ["sft", "--config", str(path), "--packing-length", "4096", "--no-bf16"],
        ["sft", "--packing-length", "4096", "--no-bf16", "--config", str(path)],
    ):
        c = _parse(*argv)
        assert (c.packing_length, c.bf16, c.seed, c.data) == (4096, False, 7, ("x.jsonl",))
    # an alias or underscore spelling on the command line counts as given too
    c = _parse("sft", "--config", str(path), "--max_length", "512", "--no_bf16")
    assert (c.packing_length, c.bf16) == (512, False)


def test_demo_reads_a_config_file_over_its_defaults(tmp_path):
    from varpack.cli.demo import DEMO_DEFAULTS

    path = _dump(tmp_path / "demo.json", {"max_steps": 3, "packing_length": 256})
    c = _parse("demo", "--config", str(path))
    assert (c.max_steps, c.packing_length) == (3, 256)
    assert (c.lr, c.lr_scheduler, c.save) == (DEMO_DEFAULTS["lr"], DEMO_DEFAULTS["lr_scheduler"], False)
    assert _parse("demo", "--config", str(path), "--max-steps", "100").max_steps == 100


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_unknown_key_names_key_file_and_suggestion(tmp_path, capsys, suffix):
    path = _dump(tmp_path / f"run{suffix}", {"packing_lenght": 1024})
    code, err = _main_err(["sft", "--config", str(path)], capsys)
    assert code == 2
    assert "unknown setting 'packing_lenght'" in err and str(path) in err
    assert "did you mean 'packing_length'?" in err
    path = _dump(tmp_path / f"run2{suffix}", {"zzz_nothing_alike": 1})
    code, err = _main_err(["sft", "--config", str(path)], capsys)
    assert code == 2 and "unknown setting 'zzz_nothing_alike'" in err and "did you mean" not in err


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("packing_length", 0, "packing_length"),  # range: the flag's own check
        ("packing_length", "many", "packing_length"),  # not a number
        ("packing_length", 2.5, "packing_length"),  # not an integer
        ("max_length", True, "packing_length"),  # a bool is no number; named by the field, through the alias
        ("warmup_steps", -1, "warmup_steps"),
        ("bf16", "maybe", "bf16"),  # text of a switch: what the flags read (true / false / yes / 0 ...) or refused
        ("overflow", "nope", "overflow"),  # a Literal: the dataclass names the choices
        ("data", 5, "data"),
        ("extra_training_args", "max_grad_norm=1", "extra_training_args"),
        ("lr_scheduler", None, "lr_scheduler"),
    ],
)
def test_bad_value_names_the_field_and_the_file(tmp_path, capsys, key, value, field):
    path = _dump(tmp_path / "run.yaml", {key: value})
    code, err = _main_err(["sft", "--config", str(path)], capsys)
    assert code == 2, err
    assert f"SFTConfig.{field} has an invalid value" in err and str(path) in err, err
    error_line = err.strip().splitlines()[-1]  # after the usage line
    assert flag_name(field) not in error_line  # the file's own names, not reworded as flags
    if field == "overflow":
        assert "choose one of" in err


def test_value_refused_for_a_flag_given_is_not_blamed_on_the_file(tmp_path, capsys):
    """--weight-decay -1 passes argparse and is refused by the dataclass: the error names the flag, not the
    file. Control: the same value from the file names the file."""
    path = _dump(tmp_path / "run.yaml", {"seed": 3})
    code, err = _main_err(["sft", "--config", str(path), "--weight-decay", "-1"], capsys)
    assert code == 2 and "--weight-decay has an invalid value" in err and str(path) not in err, err
    path = _dump(tmp_path / "wd.yaml", {"weight_decay": -1})
    code, err = _main_err(["sft", "--config", str(path)], capsys)
    assert code == 2 and "SFTConfig.weight_decay has an invalid value: -1" in err and str(path) in err, err


def test_missing_and_malformed_files(tmp_path, capsys):
    code, err = _main_err(["sft", "--config", str(tmp_path / "none.yaml")], capsys)
    assert code == 2 and "config file not found" in err and "none.yaml" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, err = _main_err(["sft", "--config", str(bad)], capsys)
    assert code == 2 and "is not valid JSON" in err and "bad.json" in err
    listed = tmp_path / "list.yaml"
    listed.write_text("- packing_length\n")
    code, err = _main_err(["sft", "--config", str(listed)], capsys)
    assert code == 2 and "must hold a mapping" in err
    twice = _dump(tmp_path / "twice.yaml", {"packing_length": 8, "max_length": 9})
    code, err = _main_err(["sft", "--config", str(twice)], capsys)
    assert code == 2 and "sets 'packing_length' twice" in err


@pytest.mark.parametrize(
    ("argv", "flag", "first", "second"),
    [
        (["--max_seq_length", "512", "--max-length", "1024"], "--packing-length", "--max_seq_length", "--max-length"),
        (["--packing-length", "512", "--packing_length", "1024"], "--packing-length", "--packing-length",
         "--packing_length"),
        (["--lr", "1e-3", "--learning_rate", "1e-4"], "--lr", "--lr", "--learning_rate"),
        (["--data", "a.jsonl", "--dataset", "b.jsonl"], "--data", "--data", "--dataset"),
        (["--use-liger-kernel", "--no_use_liger_kernel"], "--use-liger-kernel", "--use-liger-kernel",
         "--no_use_liger_kernel"),
        (["--torch-compile", "--no_torch_compile"], "--torch-compile", "--torch-compile", "--no_torch_compile"),
    ],
)  # fmt: skip
def test_two_spellings_of_one_setting_on_the_command_line_are_refused(argv, flag, first, second, capsys, monkeypatch):
    """``--max_seq_length 512 --max-length 1024`` (two spellings of one setting, one of them would be ignored)
    is refused, as a config file setting one thing twice is. One spelling given twice stays argparse's
    (the later value; a list flag adds to its list), and a switch's two sides are one spelling."""
    import varpack.cli.sft

    monkeypatch.setattr(varpack.cli.sft, "run", lambda args: pytest.fail("the run started"))
    code, err = _main_err(["sft", *argv], capsys)
    assert code == 2 and f"{flag} given twice: as {first} and {second}; give it once" in err, err
    assert _parse("sft", "--max-length", "512", "--max-length", "1024").packing_length == 1024
    assert _parse("sft", "--data", "a.jsonl", "--data", "b.jsonl").data == ("a.jsonl", "b.jsonl")
    assert _parse("sft", "--bf16", "--no-bf16").bf16 is False
    assert _parse("sft", "--torch-compile", "--no-torch-compile").torch_compile is False


@pytest.mark.parametrize("name", ["varpack_config.yaml", "varpack_config.json"])
def test_writer_round_trips_every_field(tmp_path, name):
    config = SFTConfig(**{**NON_DEFAULT, "lr": 1e-10, "num_proc": None})
    path = write_config_file(config, tmp_path / name)
    assert load_config_file(path) == config
    assert _parse("sft", "--config", str(path)) == config
    assert set(config_mapping(config)) == set(FIELDS)


def test_saved_run_records_its_resolved_config(tmp_path):
    """A 1-step tiny run with save=True writes varpack_config.yaml beside the model; read back with --config
    it is the run's config (lr resolved from the model kind). Control: a run without saving writes none."""
    import torch

    from varpack.models import load_model
    from varpack.train import run_sft

    class _Tok:
        pad_token_id = 0

        def save_pretrained(self, path):
            Path(path, "tokenizer.json").write_text("{}")

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(6):
        ids = torch.randint(0, 512, (5 + 3 * i,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": [-100, *ids[1:]], "length": len(ids)})
    out = tmp_path / "out"
    config = SFTConfig(
        output_dir=str(out),
        packing_length=32,
        attn_backend="reference",
        max_steps=1,
        extra_training_args={"use_cpu": True},
    )
    model = load_model("tiny-qwen3", vocab_size=512, attn_backend="reference")
    run = run_sft(config, print_fn=lambda *a: None, model=model, tokenizer=_Tok(), encoded=samples)
    saved = out / CONFIG_FILE_NAME
    assert saved.is_file() and (out / "model.safetensors").is_file()
    assert run.config.lr == 3e-3 and config.lr is None  # resolved
    assert run.config.torch_compile is False and config.torch_compile == "auto"  # resolved (CPU: eager)
    assert load_config_file(saved) == run.config
    assert _parse("sft", "--config", str(saved)) == run.config
    assert "varpack sft --config" in saved.read_text().splitlines()[0]

    out2 = tmp_path / "mine"
    out2.mkdir()
    model = load_model("tiny-qwen3", vocab_size=512, attn_backend="reference")
    run_sft(
        dataclasses.replace(config, output_dir=str(out2), save=False),
        print_fn=lambda *a: None,
        model=model,
        tokenizer=_Tok(),
        encoded=samples,
    )
    assert not (out2 / CONFIG_FILE_NAME).exists()


def test_reading_a_config_file_imports_no_torch(tmp_path):
    path = _dump(tmp_path / "run.yaml", {"packing_length": 512, "data": [str(tmp_path / "missing.jsonl")]})
    code = f"""
import sys
from varpack.cli.main import main
rc = main(["sft", "--config", {str(path)!r}])
assert rc == 1, rc  # the missing data file, reported before anything heavy is imported
heavy = sorted(m for m in ("torch", "transformers", "datasets") if m in sys.modules)
assert not heavy, heavy
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "missing.jsonl" in res.stderr


# ------------------------------------------------------------------------------------------------------
# item 5: TRL / ms-swift spellings
# ------------------------------------------------------------------------------------------------------
def _field_argv(name: str, spelling: str) -> list[str]:
    """The flags giving field ``name`` its NON_DEFAULT value, spelled ``--<spelling>``."""
    value = NON_DEFAULT[name]
    if HINTS[name] is bool:
        return ["--" + spelling] if value else ["--no" + ("_" if "_" in spelling else "-") + spelling]
    if isinstance(value, tuple):
        return ["--" + spelling, *value]
    if isinstance(value, dict):
        return ["--" + spelling, json.dumps(value)]
    return ["--" + spelling, str(value)]


SPELLINGS = sorted((spelling, name) for spelling, name in field_names().items())
#: settings only valid together with another one (SFTConfig.DEPENDENT_SETTINGS: lora_r without lora, ...)
_DPO = {"objective": "dpo", "overflow": "drop"}  # dpo keeps pairs whole: not varpack demo's default overflow split
REQUIRES: dict[str, dict] = {
    **{name: {"lora": True} for name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_merge")},
    "streaming": {"max_steps": 5},
    "buffer_size": {"streaming": True, "max_steps": 5},
    "context_parallel_attention": {"context_parallel": 2},
    "beta": _DPO,
    "loss_type": _DPO,
    "label_smoothing": {"loss_type": "robust", **_DPO},
    "objective": {"overflow": "drop"},
}


def _alone(name: str) -> dict:
    """The field at its NON_DEFAULT value, plus what it requires."""
    return {name: NON_DEFAULT[name], **REQUIRES.get(name, {})}


def test_every_field_has_its_underscore_spelling():
    names = field_names()
    for name in FIELDS:
        assert names[name] == name and names[name.replace("_", "-")] == name
    assert names["max_length"] == names["max_seq_length"] == "packing_length"
    assert names["attn_impl"] == "attn_backend" and names["learning_rate"] == "lr"
    assert names["per_device_train_batch_size"] == "packs_per_step"


@pytest.mark.parametrize(("spelling", "name"), SPELLINGS)
def test_every_spelling_parses_to_the_canonical_config(spelling, name):
    extra = [a for req in REQUIRES.get(name, {}) for a in _field_argv(req, req.replace("_", "-"))]
    canonical = _parse("sft", *extra, *_field_argv(name, name.replace("_", "-")))
    assert getattr(canonical, name) == getattr(SFTConfig(**_alone(name)), name)
    assert canonical != SFTConfig()  # the value is not the default: the alias must carry it
    assert _parse("sft", *extra, *_field_argv(name, spelling)) == canonical
    assert _parse("demo", *extra, *_field_argv(name, spelling)) == _parse(
        "demo", *extra, *_field_argv(name, name.replace("_", "-"))
    )


@pytest.mark.parametrize(("spelling", "name"), SPELLINGS)
def test_every_spelling_works_as_a_file_key(tmp_path, spelling, name):
    path = _dump(tmp_path / "run.yaml", {spelling: NON_DEFAULT[name], **REQUIRES.get(name, {})})
    assert _parse("sft", "--config", str(path)) == SFTConfig(**_alone(name))


def test_negative_switch_spellings():
    assert _parse("sft", "--no_save").save is False and _parse("sft", "--no-save").save is False
    assert _parse("demo", "--save").save is True
    assert _parse("sft", "--gradient_checkpointing").gradient_checkpointing is True
    assert (
        _parse("sft", "--gradient_checkpointing", "--no_gradient_checkpointing").gradient_checkpointing
        is False
    )


def test_aliases_do_not_clutter_help():
    help_text = build_parser()._subparsers._group_actions[0].choices["sft"].format_help()
    text, epilog = " ".join(help_text.split()).split("Every flag also takes its underscore spelling")
    assert "--packing_length" in epilog and "--padding_free" in epilog  # said once, at the end
    assert "--packing_length" not in text
    assert "--max-length" not in text and "--no_bf16," not in text and "--padding_free " not in text
    assert text.count("--max_length") == 1  # named once, in --packing-length's help
    assert "(also --max_length, --max_seq_length)" in text and "(also --attn_impl)" in text


@pytest.mark.parametrize("switch", sorted(ALWAYS_ON))
def test_always_on_switches(tmp_path, capsys, switch):
    """`--padding_free` / `--padding_free true` change nothing; `false` is a usage error saying why."""
    for argv in ([f"--{switch}"], [f"--{switch}", "true"], [f"--{switch.replace('_', '-')}", "True"]):
        assert _parse("sft", *argv, "--seed", "3") == SFTConfig(seed=3)
    for value in ("false", "0", "False"):
        code, err = _main_err(["sft", f"--{switch}", value], capsys)
        assert code == 2 and "cannot be false" in err and "always" in err, err
    code, err = _main_err(["sft", f"--{switch}", "maybe"], capsys)
    assert code == 2 and "must be true or false" in err
    assert _parse("sft", "--config", str(_dump(tmp_path / "on.yaml", {switch: True}))) == SFTConfig()
    code, err = _main_err(["sft", "--config", str(_dump(tmp_path / "off.yaml", {switch: False}))], capsys)
    assert code == 2 and "only true is accepted" in err and "off.yaml" in err


def test_saved_config_reruns_from_another_directory(tmp_path, monkeypatch):
    """A run given a relative --data path saves varpack_config.yaml with absolute local paths, so "rerun with:
    varpack sft --config varpack_config.yaml" works from the output folder (it failed with "chat data file not
    found" when the relative path was saved as given)."""
    from varpack.train.sft import _rerunnable

    work = tmp_path / "work"
    work.mkdir()
    (work / "small.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    monkeypatch.chdir(work)
    config = SFTConfig(data=("small.jsonl",), output_dir="runs/a", model="tiny-qwen3")
    saved = _rerunnable(config)
    assert saved.data == (str(work / "small.jsonl"),) and saved.output_dir == str(work / "runs" / "a")
    assert saved.model == "tiny-qwen3"  # a built-in name is not a path
    path = write_config_file(saved, tmp_path / CONFIG_FILE_NAME)
    monkeypatch.chdir(tmp_path)
    again = load_config_file(path)
    assert all(Path(p).is_file() for p in again.data)
    assert dataclasses.replace(again, data=config.data, output_dir=config.output_dir) == config


def test_saved_config_rerun_line_works_from_any_directory(tmp_path, monkeypatch):
    """The first line's "rerun with: varpack sft --config ..." names the saved file by its absolute path, so the
    line copied from `cat runs/a/varpack_config.yaml` runs from the project folder too (it said
    "--config varpack_config.yaml", which failed there with "config file not found")."""
    import shlex

    out = tmp_path / "runs dir" / "a"
    out.mkdir(parents=True)
    monkeypatch.chdir(out)
    path = write_config_file(SFTConfig(seed=7), CONFIG_FILE_NAME)  # a relative path, as the caller may give
    first = path.read_text().splitlines()[0]
    command = shlex.split(first.split("rerun with: ", 1)[1])
    assert command[:3] == ["varpack", "sft", "--config"] and len(command) == 4, first
    monkeypatch.chdir(tmp_path)  # elsewhere
    assert Path(command[3]).is_absolute() and load_config_file(command[3]).seed == 7


def test_quoted_booleans_in_a_config_file(tmp_path, capsys):
    """`bf16: 'false'` / `gradient_checkpointing: "True"` are read as the booleans they spell (a YAML writer may
    quote them; they were refused as "must be true or false"); other strings and numbers are still refused,
    naming the value."""
    got = _parse(
        "sft",
        "--config",
        str(_dump(tmp_path / "q.yaml", {"bf16": "false", "gradient_checkpointing": "True"})),
    )
    assert got == SFTConfig(bf16=False, gradient_checkpointing=True)
    # the other spellings of the one parser (varpack._argtypes.parse_bool: the flags', SFTConfig's)
    quoted = _dump(tmp_path / "q2.yaml", {"bf16": "no", "gradient_checkpointing": "1"})
    assert _parse("sft", "--config", str(quoted)) == SFTConfig(bf16=False, gradient_checkpointing=True)
    for bad in ("maybe", "on", 1):
        code, err = _main_err(["sft", "--config", str(_dump(tmp_path / "bad.yaml", {"bf16": bad}))], capsys)
        assert code == 2 and "must be true or false" in err and repr(bad) in err, err
