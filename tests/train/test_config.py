"""varpack.train: SFTConfig <-> `varpack sft` flags (generated from the fields), Literal choices, and the
objectives seam (the SFT objective's loss is the packed causal-LM loss, equal to the unpacked one)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import typing

import pytest

from varpack.cli.main import build_parser, main
from varpack.train.cli_flags import config_from_args, config_to_argv
from varpack.train.config import SFTConfig, literal_choices
from varpack.train.fields import CLI_TYPES, cli_types, flag_name

FIELDS = [f.name for f in dataclasses.fields(SFTConfig)]
HINTS = typing.get_type_hints(SFTConfig)
LITERAL_FIELDS = [name for name in FIELDS if literal_choices(HINTS[name]) is not None]

#: a value for every field, none of them the default
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
    lora=True,
    lora_r=8,
    lora_alpha=16,
    lora_dropout=0.05,
    lora_target_modules="q_proj,v_proj",
    lora_merge=True,
    streaming=True,
    buffer_size=500,
    report_to="tensorboard",
    extra_training_args={"max_grad_norm": 0.5, "optim": "sgd"},
    objective="dpo",
    beta=0.3,
    label_smoothing=0.1,
    loss_type="robust",
)


def _subparser(cmd):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a.choices, dict))
    return sub.choices[cmd]


@pytest.mark.parametrize("cmd", ["sft", "demo"])
def test_every_field_is_a_flag(cmd):
    """Each SFTConfig field has its --kebab-case flag writing to the field's name (none unreachable)."""
    by_flag = {s: a for a in _subparser(cmd)._actions for s in a.option_strings}
    missing = [name for name in FIELDS if flag_name(name) not in by_flag]
    assert not missing, missing
    for name in FIELDS:
        assert by_flag[flag_name(name)].dest == name
        if HINTS[name] is bool:  # --flag / --no-flag
            assert by_flag["--no-" + flag_name(name)[2:]].dest == name


def test_non_default_values_round_trip_through_the_flags():
    """config -> argv -> `varpack sft` parser -> config is the identity, for a non-default value of every field."""
    assert set(NON_DEFAULT) == set(FIELDS)
    default = SFTConfig()
    assert [n for n in FIELDS if getattr(default, n) == NON_DEFAULT[n]] == []
    direct = SFTConfig(**NON_DEFAULT)
    argv = ["sft", *config_to_argv(direct)]
    parsed = config_from_args(build_parser().parse_args(argv))
    assert parsed == direct
    # and with no flags at all: the dataclass defaults
    assert config_from_args(build_parser().parse_args(["sft"])) == SFTConfig()


def test_fields_the_old_cli_could_not_reach():
    argv = ["sft", "--weight-decay", "0.05", "--dtype", "float16", "--dataloader-num-workers", "3"]
    argv += ["--report-to", "wandb", "--extra-training-args", '{"max_grad_norm": 2.0}', "--no-bf16"]
    c = config_from_args(build_parser().parse_args(argv))
    assert (c.weight_decay, c.dtype, c.dataloader_num_workers, c.report_to) == (0.05, "float16", 3, "wandb")
    assert c.extra_training_args == {"max_grad_norm": 2.0} and c.bf16 is False


def test_extra_training_args_that_varpack_sets_are_refused_by_name(tmp_path, capsys):
    """A TrainingArguments key that an SFTConfig field sets (it was applied last: learning_rate overrode --lr
    behind the optimizer line, per_device_train_batch_size was read nowhere, gradient_accumulation_steps
    slipped past the CUDA-graph check) or that varpack cannot run exactly (NEFTune) is refused, naming the flag;
    any other key passes (control). The table is every key training_arguments sets from a field."""
    import transformers

    from varpack.train.config import EXTRA_ARGS_OF_FIELDS, EXTRA_ARGS_REFUSED
    from varpack.train.sft import training_arguments

    with pytest.raises(ValueError, match=r"sets TrainingArguments.learning_rate, .* --lr \(lr=\.\.\.\): give it there"):
        SFTConfig(extra_training_args={"max_grad_norm": 1.0, "learning_rate": 0.5})
    with pytest.raises(ValueError, match="TrainingArguments.per_device_train_batch_size, .* --packs-per-step"):
        SFTConfig(extra_training_args={"per_device_train_batch_size": 4})
    with pytest.raises(ValueError, match="TrainingArguments.neftune_noise_alpha: NEFTune .* what it is packed with"):
        SFTConfig(extra_training_args={"neftune_noise_alpha": 5})
    # transformers 5's name of gradient_checkpointing; Liger's layers; a label smoothing the loss never reads
    with pytest.raises(ValueError, match="TrainingArguments.activation_checkpointing, .* --gradient-checkpointing"):
        SFTConfig(gradient_checkpointing=True, extra_training_args={"activation_checkpointing": False})
    with pytest.raises(ValueError, match="TrainingArguments.use_liger_kernel: .* --use-liger-kernel"):
        SFTConfig(extra_training_args={"use_liger_kernel": True})
    with pytest.raises(ValueError, match="TrainingArguments.label_smoothing_factor: .* no label smoothing"):
        SFTConfig(extra_training_args={"label_smoothing_factor": 0.1})
    assert SFTConfig(extra_training_args={"max_grad_norm": 1.0, "optim": "sgd"}).extra_training_args
    code = main(["sft", "--max-steps", "2", "--extra-training-args", '{"max_steps": 5}'])
    assert code == 2 and "--extra-training-args sets TrainingArguments.max_steps, which varpack sets from its own setting --max-steps" in (
        capsys.readouterr().err
    )

    # the table is what training_arguments sets from the fields: each key carries its field's (non-default) value
    cfg = SFTConfig(
        output_dir=str(tmp_path), packs_per_step=3, grad_accum=5, epochs=7, max_steps=11, lr=0.0123,
        lr_scheduler="cosine", warmup_steps=13, weight_decay=0.017, logging_steps=19, report_to="tensorboard",
        dataloader_num_workers=2, bf16=True, seed=23, gradient_checkpointing=True,
    )  # fmt: skip
    args = training_arguments(cfg)
    for key, name in EXTRA_ARGS_OF_FIELDS.items():
        value = getattr(args, key)
        assert value == getattr(cfg, name) or value == [getattr(cfg, name)], (key, value)
    fields = set(transformers.training_args.TrainingArguments.__dataclass_fields__)
    assert args.remove_unused_columns is False and set(EXTRA_ARGS_REFUSED) <= fields


@pytest.mark.parametrize(
    "losses, code, said",
    [
        ([11.9, 7.0], 0, "the loss fell."),
        ([11.9, 12.0], 1, "the loss did NOT fall."),
        ([11.9], 0, "one logged loss, 11.9000 (step 1): whether it falls needs two logged steps"),
    ],
)
def test_demo_judges_the_loss_from_two_logged_steps(monkeypatch, capsys, losses, code, said):
    """A demo shortened to one logged step (``--max-steps 2`` with the demo's logging every 5) exited 1 with
    "the loss did NOT fall" comparing step 1 with itself."""
    import types

    import varpack.train.sft as sft

    history = [{"loss": x, "step": 1 + 5 * i} for i, x in enumerate(losses)]
    monkeypatch.setattr(sft, "run_sft", lambda config: types.SimpleNamespace(history=history))
    monkeypatch.setattr("varpack.cli._common.check_data_files", lambda data: None)
    assert main(["demo", "--max-steps", "2"]) == code
    assert said in capsys.readouterr().out


def test_demo_keeps_its_defaults_and_save_flag():
    from varpack.cli.demo import DEMO_DEFAULTS

    demo = config_from_args(build_parser().parse_args(["demo"]))
    for name, value in DEMO_DEFAULTS.items():
        assert getattr(demo, name) == value, name
    assert demo.save is False
    assert config_from_args(build_parser().parse_args(["demo", "--save"])).save is True
    assert config_from_args(build_parser().parse_args(["sft", "--no-save"])).save is False


@pytest.mark.parametrize("name", LITERAL_FIELDS)
def test_literal_field_rejects_a_bad_value(name, capsys):
    """The dataclass names the field and its choices; the command line names the flag (exit code 2)."""
    choices = literal_choices(HINTS[name])
    with pytest.raises(ValueError, match=rf"SFTConfig\.{name} has an invalid value: 'nope'; choose one of"):
        SFTConfig(**{name: "nope"})
    parent = next((p for n, _, _, p in DEPENDENT if n == name), {})  # loss_type robust: with objective dpo
    for good in choices:
        assert getattr(SFTConfig(**{name: good, **parent}), name) == good
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["sft", flag_name(name), "nope"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag_name(name) in err and repr(choices[-1]) in err


def test_literal_fields_cover_the_closed_choices():
    assert set(LITERAL_FIELDS) >= {
        "packing_strategy",
        "overflow",
        "loss_reduction",
        "loss_impl",
        "attn_backend",
        "gated_delta_backend",
        "dtype",
    }


def test_literals_agree_with_the_registries():
    """A planner strategy / overflow policy / attention backend added in its registry must be added here too."""
    from varpack.cli._common import ATTN_BACKENDS
    from varpack.plan import OVERFLOW_POLICIES, STRATEGIES

    assert literal_choices(HINTS["packing_strategy"]) == STRATEGIES
    assert literal_choices(HINTS["overflow"]) == OVERFLOW_POLICIES
    assert literal_choices(HINTS["attn_backend"]) == ATTN_BACKENDS
    from varpack.cli._common import GATED_DELTA_BACKENDS

    assert literal_choices(HINTS["gated_delta_backend"]) == GATED_DELTA_BACKENDS
    from varpack.train.objectives import OBJECTIVES
    from varpack.train.objectives.dpo import DPO_LOSS_TYPES

    assert literal_choices(HINTS["objective"]) == tuple(OBJECTIVES)
    assert literal_choices(HINTS["loss_type"]) == DPO_LOSS_TYPES
    assert set(CLI_TYPES) == set(cli_types())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("weight_decay", -0.1),
        ("dataloader_num_workers", -1),
        ("warmup_steps", -2),
        ("num_proc", 0),
        ("label_smoothing", 0.5),
        ("beta", float("inf")),
    ],
)
def test_new_numeric_checks_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SFTConfig\.{field} has an invalid value"):
        SFTConfig(**{field: value})


#: each setting of DEPENDENT_SETTINGS: the flags that give it a non-default value, the flag it needs, and the
#: settings that turn that on
DEPENDENT = [
    ("lora_r", ["--lora-r", "8"], "--lora", {"lora": True}),
    ("lora_alpha", ["--lora-alpha", "8"], "--lora", {"lora": True}),
    ("lora_dropout", ["--lora-dropout", "0.5"], "--lora", {"lora": True}),
    ("lora_target_modules", ["--lora-target-modules", "nonexistent_proj"], "--lora", {"lora": True}),
    ("lora_merge", ["--lora-merge"], "--lora", {"lora": True}),
    ("beta", ["--beta", "0.5"], "--objective dpo", {"objective": "dpo"}),
    ("loss_type", ["--loss-type", "robust"], "--objective dpo", {"objective": "dpo"}),
    ("label_smoothing", ["--label-smoothing", "0.2"], "--objective dpo", {"objective": "dpo", "loss_type": "robust"}),
    ("buffer_size", ["--buffer-size", "10"], "--streaming", {"streaming": True, "max_steps": 1}),
    ("context_parallel_attention", ["--context-parallel-attention", "ring"], "--context-parallel N",
     {"context_parallel": 2}),
]  # fmt: skip


def test_dependent_settings_table_is_tested():
    from varpack.train.config import DEPENDENT_SETTINGS

    assert sorted(name for name, *_ in DEPENDENT) == sorted(DEPENDENT_SETTINGS)


@pytest.mark.parametrize(("name", "argv", "needs", "parent"), DEPENDENT, ids=[d[0] for d in DEPENDENT])
def test_setting_without_the_one_it_needs_is_refused(name, argv, needs, parent, tmp_path, capsys):
    """A setting read only with another (--lora-r without --lora, --beta without --objective dpo, --buffer-size
    without --streaming, ...) is refused by name, naming what it needs, from a flag and from a config file
    alike; its default value alone, or the setting beside its parent, pass; a file that has both, run with the
    parent turned off on the command line, runs without the dependent value (the command line wins)."""
    import yaml

    config = config_from_args(build_parser().parse_args(["sft", *argv, *_flags(parent)]))
    value = getattr(config, name)
    assert value != getattr(SFTConfig(), name)
    with pytest.raises(ValueError, match=rf"SFTConfig\.{name} has an invalid value: .*\(needs {re.escape(needs)}"):
        SFTConfig(**{name: value})
    assert main(["sft", "--max-steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{argv[0]} has an invalid value" in err and f"(needs {needs}" in err, err
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({name: value, "max_steps": 1}))
    assert main(["sft", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"SFTConfig.{name} has an invalid value" in err and "from config file" in err, err
    # beside what it needs, and at its default alone: accepted
    assert getattr(SFTConfig(**{name: value, **parent}), name) == value
    default = getattr(SFTConfig(), name)
    assert getattr(SFTConfig(**{name: default}), name) == default
    path.write_text(yaml.safe_dump({name: value, "max_steps": 1, **parent}))
    assert getattr(config_from_args(build_parser().parse_args(["sft", "--config", str(path)])), name) == value
    off = {"lora": ["--no-lora"], "objective": ["--objective", "sft"], "streaming": ["--no-streaming"],
           "context_parallel": ["--context-parallel", "1"]}[next(iter(parent))]  # fmt: skip
    turned_off = config_from_args(build_parser().parse_args(["sft", "--config", str(path), *off]))
    assert getattr(turned_off, name) == default


def _flags(settings: dict) -> list[str]:
    out: list[str] = []
    for key, value in settings.items():
        flag = flag_name(key)
        out += [flag] if value is True else [flag, str(value)]
    return out


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [("buffer_size", 1, "must be >= 2"), ("grad_accum", 0, "must be >= 1"), ("lora_dropout", 1.0, "[0, 1)"),
     ("lr", float("nan"), "finite, > 0"), ("max_steps", 0, "-1 (use epochs) or >= 1")],
)
def test_invalid_value_says_what_is_valid(field, value, rule):
    """``--buffer-size 1`` said only "has an invalid value: 1"; the error states the rule."""
    with pytest.raises(ValueError, match=rf"SFTConfig\.{field} has an invalid value: .*\(.*{re.escape(rule)}"):
        SFTConfig(**{field: value})


@pytest.mark.parametrize("value", ["0", "1", "-5"])
def test_buffer_size_flag_states_the_configs_rule(value, capsys):
    """--buffer-size 0 / -5 and 1 once gave two different rules (">= 1" from argparse, then ">= 2" from the
    config): the flag's own check now states the config's rule."""
    assert main(["sft", "--streaming", "--max-steps", "1", "--buffer-size", value]) == 2
    assert "--buffer-size: must be an integer >= 2" in capsys.readouterr().err


def test_bad_value_of_a_new_flag_is_a_usage_error(capsys):
    """--weight-decay has no argparse range check: SFTConfig refuses it and the CLI words it as the flag."""
    assert main(["sft", "--weight-decay", "-1", "--max-steps", "1"]) == 2
    assert "--weight-decay has an invalid value" in capsys.readouterr().err
    assert main(["sft", "--extra-training-args", "[1]"]) == 2
    assert "--extra-training-args" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lr-scheduler", "foo"], "--lr-scheduler has an invalid value: 'foo'; choose one of linear, cosine"),
        (["--extra-training-args", '{"not_a_real_arg": 1}'],
         "--extra-training-args sets 'not_a_real_arg', which transformers' TrainingArguments does not take"),
        (["--extra-training-args", '{"max_grad_nrom": 1, "optim": "sgd"}'],
         "--extra-training-args sets 'max_grad_nrom' (did you mean 'max_grad_norm'?), which"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("cmd", ["sft", "demo"])
def test_training_arguments_checked_before_the_data_is_encoded(cmd, argv, expected, tmp_path, capsys, monkeypatch):
    """``--lr-scheduler foo`` and an unknown ``--extra-training-args`` key are a usage error naming the flag, by
    transformers' own definitions, before the run starts (not in transformers' words once the Trainer is built,
    after the data was encoded); from a config file alike."""
    import yaml

    import varpack.train.sft

    monkeypatch.setattr(varpack.train.sft, "run_sft", lambda *a, **k: pytest.fail("the run started"))
    assert main([cmd, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: varpack {cmd}") and expected in err, err
    path = tmp_path / "run.yaml"
    value = argv[1] if argv[0] == "--lr-scheduler" else json.loads(argv[1])
    path.write_text(yaml.safe_dump({argv[0][2:].replace("-", "_"): value}))
    assert main([cmd, "--config", str(path)]) == 2
    assert expected in capsys.readouterr().err


def test_training_arguments_check_reads_transformers_definitions(monkeypatch):
    """Every transformers scheduler name and TrainingArguments keyword passes; build_sft refuses a bad one
    before any data is loaded."""
    import transformers

    import varpack.train.sft
    from varpack.train.config import check_training_arguments

    for scheduler in transformers.SchedulerType:
        check_training_arguments(SFTConfig(lr_scheduler=scheduler.value))
    with pytest.raises(ValueError, match="SFTConfig.lr_scheduler has an invalid value: 'Linear'; choose one of"):
        check_training_arguments(SFTConfig(lr_scheduler="Linear"))
    check_training_arguments(SFTConfig(extra_training_args={"max_grad_norm": 0.5, "optim": "sgd", "adam_beta2": 0.9}))
    with pytest.raises(ValueError, match=r"sets 'nope', 'adam_beta_2' \(did you mean 'adam_beta2'\?\), which"):
        check_training_arguments(SFTConfig(extra_training_args={"nope": 1, "adam_beta_2": 0.9}))
    monkeypatch.setattr(varpack.train.sft, "load_and_encode", lambda *a, **k: pytest.fail("data loaded"))
    with pytest.raises(ValueError, match="SFTConfig.lr_scheduler has an invalid value: 'foo'"):
        varpack.train.sft.build_sft(SFTConfig(lr_scheduler="foo"))


def test_config_and_flags_import_no_torch():
    code = (
        "import sys; import varpack.train; from varpack.train import SFTConfig, default_lr; "
        "import varpack.train.cli_flags, varpack.train.config; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------------------
# objectives
# ------------------------------------------------------------------------------------------------------
VOCAB = 256


def _packed_batch():
    """A collated packed batch of 3 samples and the samples; each sample's first label is then made a real
    token, so only ``seq_idx`` keeps the loss from scoring predictions across sample boundaries."""
    import torch

    from varpack.collate import PaddingFreeCollator

    g = torch.Generator().manual_seed(0)
    samples = []
    for length in (5, 9, 4):
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": [-100, *ids[1:]]})
    batch = PaddingFreeCollator()(samples)
    starts = batch["cu_seq_lens_q"][:-1].long()
    batch["labels"][0, starts] = batch["input_ids"][0, starts]
    return batch, samples


def _unpacked_loss(model, samples, reduction):
    """Reference: each sample alone, plain torch cross entropy."""
    import torch
    import torch.nn.functional as F

    sums, counts = [], []
    for s in samples:
        ids = torch.tensor([s["input_ids"]])
        labels = torch.tensor(s["labels"][1:])
        logits = model(input_ids=ids).logits[0, :-1].float()
        mask = labels != -100
        sums.append(F.cross_entropy(logits[mask], labels[mask], reduction="sum"))
        counts.append(int(mask.sum()))
    if reduction == "token":
        return sum(sums) / sum(counts)
    return sum(s / c for s, c in zip(sums, counts, strict=True)) / len(samples)


def test_registry_gives_the_sft_objective():
    from varpack.train.objectives import OBJECTIVES, get_objective
    from varpack.train.objectives.sft import CausalLMObjective

    assert isinstance(get_objective("sft"), CausalLMObjective) and OBJECTIVES["sft"].name == "sft"
    with pytest.raises(ValueError, match=r"unknown objective 'ppo'; choose one of \['dpo', 'sft'\]"):
        get_objective("ppo")


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_sft_objective_loss_is_the_packed_causal_lm_loss(reduction):
    """The objective's loss == varpack.loss.causal_lm_loss of the model's logits == the unpacked loss;
    negative control: without seq_idx it scores the cross-boundary predictions and differs."""
    import torch

    from varpack.loss import causal_lm_loss
    from varpack.models import load_model
    from varpack.schema import NOT_MODEL_INPUTS
    from varpack.train.objectives import get_objective

    torch.manual_seed(0)
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference").eval()
    batch, samples = _packed_batch()
    objective = get_objective("sft")
    with torch.no_grad():
        result = objective.loss(model, batch, reduction=reduction)
        assert result.impl == "logits"
        expected = causal_lm_loss(
            model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}).logits,
            batch["labels"],
            reduction=reduction,
            seq_idx=batch["seq_idx"],
        )
        unpacked = _unpacked_loss(model, samples, reduction)
        torch.testing.assert_close(result.loss, expected, rtol=0, atol=0)
        torch.testing.assert_close(result.loss, unpacked, rtol=1e-5, atol=1e-5)
        if reduction == "token":
            no_boundaries = {k: v for k, v in batch.items() if k != "seq_idx"}
            dropped = objective.loss(model, no_boundaries, reduction=reduction).loss
            assert (dropped - unpacked).abs().item() > 1e-3
        else:  # the sample mean cannot be taken without seq_idx: refused, not guessed
            with pytest.raises(ValueError, match="seq_idx"):
                objective.loss(model, {k: v for k, v in batch.items() if k != "seq_idx"}, reduction=reduction)
    n = objective.count_items(batch, reduction=reduction)
    assert int(n) == (sum(len(s["input_ids"]) - 1 for s in samples) if reduction == "token" else len(samples))


def test_trainer_asks_its_objective_for_the_loss(tmp_path, monkeypatch):
    """PackedSFTTrainer.compute_loss is the objective's loss (a scaled objective scales it)."""
    import torch

    from varpack.models import load_model
    from varpack.train import SFTConfig as Cfg
    from varpack.train import build_sft
    from varpack.train.objectives import OBJECTIVES
    from varpack.train.objectives.base import ObjectiveLoss

    class _Tok:
        pad_token_id = 0

    samples = [dict(s, length=len(s["input_ids"])) for s in _packed_batch()[1]]
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    cfg = Cfg(
        output_dir=str(tmp_path / "o"),
        packing_length=32,
        attn_backend="reference",
        save=False,
        loss_impl="logits",
        extra_training_args={"use_cpu": True},
    )
    run = build_sft(cfg, model=model, tokenizer=_Tok(), encoded=samples)
    assert run.trainer.objective is OBJECTIVES["sft"]
    batch = next(iter(run.trainer.get_train_dataloader()))
    with torch.no_grad():
        base = run.trainer.compute_loss(model, batch)
        direct = OBJECTIVES["sft"].loss(model, batch).loss

        class Doubled:
            name = "sft"

            def loss(self, *a, **k):
                r = OBJECTIVES["sft"].loss(*a, **k)
                return ObjectiveLoss(2 * r.loss, r.outputs, r.impl)

        monkeypatch.setattr(run.trainer, "objective", Doubled())
        doubled = run.trainer.compute_loss(model, batch)
    torch.testing.assert_close(base, direct, rtol=0, atol=0)
    torch.testing.assert_close(doubled, 2 * base)
