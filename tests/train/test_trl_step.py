"""The TRL drop-in's step (`VarpackSFTTrainer(cuda_graphs=, compile_layers=)`): what it runs by default and why
(the `speed` line), every fallback of `cuda_graphs="auto"` and every refusal of `cuda_graphs=True` (a CUDA run
stood in by the device check, no CUDA step), TRL's `torch_compile` mapped to varpack's compiled layers, static
shapes on the CPU equal to the dynamic run (negative control: the pad tokens supervised), compiled layers
(`aot_eager`) equal to eager; on a GPU, the default drop-in runs CUDA graphs and matches the eager drop-in."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")  # the `trl` extra; `make test` installs it
datasets = pytest.importorskip("datasets")

from tests._exact import LOSS_RTOL, assert_differs, assert_exact  # noqa: E402
from tests.train.test_cuda_graphs import _supervise_pads  # noqa: E402
from tests.train.test_trl import VOCAB, rows, tiny_model, tokenizer, trl_args  # noqa: E402, F401
from varpack.models import load_model  # noqa: E402
from varpack.train import trl as trl_module  # noqa: E402
from varpack.train.config import GRAPHS_AUTO_REASON  # noqa: E402
from varpack.train.trl import VarpackSFTTrainer  # noqa: E402


def graph_model(name="tiny-qwen3", **kw):
    """A model the graph step takes: bf16 weights, varpack attention ``auto``."""
    return load_model(name, **{"vocab_size": VOCAB, "attn_backend": "auto", "dtype": torch.bfloat16, "seed": 0, **kw})


def make(tmp_path, tokenizer, *, model=None, args_kw=None, **kw):  # noqa: F811
    base = dict(gradient_accumulation_steps=1)
    base.update(args_kw or {})
    return VarpackSFTTrainer(
        model=model if model is not None else graph_model(),
        args=trl_args(tmp_path, **base),
        train_dataset=datasets.Dataset.from_list(rows()),
        processing_class=tokenizer,
        **kw,
    )


@pytest.fixture
def on_cuda(monkeypatch):
    """The device check answers "cuda" (the model stays on the CPU); layer compilation is recorded, not run."""
    from varpack.integrations import cuda_graphs, kernels

    calls = {"graphs": [], "compile": []}
    monkeypatch.setattr(trl_module, "_device_type", lambda args: "cuda")
    monkeypatch.setattr(
        cuda_graphs, "compile_layers_as_graphs", lambda model, **k: calls["graphs"].append((model, k)) or 2
    )
    monkeypatch.setattr(kernels, "compile_layers", lambda model, **k: calls["compile"].append((model, k)) or 2)
    # the attention a captured layer resolves to on the GPU (FlashAttention-4): not resolvable without one
    monkeypatch.setattr(cuda_graphs, "attention_refusal", lambda model, **k: calls["attention"].append(k))
    calls["attention"] = []
    return calls


# -- the default on the CPU ----------------------------------------------------------------------------------
def test_cpu_default_is_eager_and_says_why(tmp_path, tokenizer, capsys):  # noqa: F811
    trainer = make(tmp_path, tokenizer, model=tiny_model(), attn_backend="reference", args_kw={"max_steps": 1})
    want = (
        "eager + chunked linear CE (auto: CPU run; compiled by default on CUDA only); "
        "CUDA graphs off (auto: CPU run; CUDA graphs need a CUDA GPU)"
    )
    assert trainer.speed_line == want
    assert not trainer.cuda_graphs and trainer.static_shape is None
    assert not getattr(trainer.model, "_varpack_compiled", None)
    trainer.train()
    out = capsys.readouterr().out
    assert out.count(f"speed     {want}") == 1 and trainer.speed_line == want


# -- the graph step, chosen on a (stood-in) CUDA run --------------------------------------------------------
def test_auto_runs_graphs_where_nothing_conflicts(tmp_path, tokenizer, on_cuda):  # noqa: F811
    trainer = make(tmp_path, tokenizer)
    assert trainer.cuda_graphs and on_cuda["compile"] == []
    (model, kw), = on_cuda["graphs"]
    assert model is trainer.model and "cuda_graphs='auto'" in kw["what"]
    shape = trainer.static_shape
    inner = trainer.data_collator.collator
    assert inner.static_shape == shape and inner.pad_to_multiple_of is None
    for batch in trainer.get_train_dataloader():
        assert tuple(batch["input_ids"].shape) == (1, shape.tokens)
        assert batch["varlen_meta"].num_seqs == shape.segments
    line = trainer.speed_line
    assert line.startswith(f"static shapes {shape.describe()} (pad ") and "CUDA graphs per layer" in line
    assert line.endswith(
        "(auto on one CUDA GPU: fastest measured, benchmarks/RESULTS.md); the first steps compile and capture "
        "every decoder layer; cuda_graphs=False for dynamic shapes"
    ), line
    assert trainer.graph_choice.on and trainer.step_choice.on


def test_torch_compile_maps_to_varpack_layers(tmp_path, tokenizer, on_cuda):  # noqa: F811
    """TRL's torch_compile=True: the graph layers (or regional compile), never transformers' whole-model
    compile around them (TRL gets args with torch_compile=False; accelerate has no dynamo backend)."""
    from accelerate.utils import DynamoBackend

    trainer = make(tmp_path, tokenizer, args_kw={"torch_compile": True})
    assert trainer.cuda_graphs and len(on_cuda["graphs"]) == 1
    assert trainer.args.torch_compile is False and trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
    assert "torch_compile=True: varpack's compiled layers (transformers' whole-model compile off)" in trainer.speed_line
    trainer = make(tmp_path, tokenizer, args_kw={"torch_compile": True, "gradient_accumulation_steps": 2})
    assert not trainer.cuda_graphs and len(on_cuda["compile"]) == 1
    assert trainer.speed_line.startswith(
        "regional torch.compile + chunked linear CE (torch_compile=True: varpack's compiled layers"
    ), trainer.speed_line


def _peft(tmp_path, tokenizer):  # noqa: F811
    from peft import LoraConfig

    return {"peft_config": LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")}


#: name -> (trainer keywords or a function of (tmp_path, tokenizer) giving them, SFTConfig keywords, model
#: keywords or None, the setting the refusal names, a fragment of the auto reason, the fix in the hint or None)
CONFLICTS = {
    "grad_accum": ({}, {"gradient_accumulation_steps": 2}, {}, "gradient_accumulation_steps=2", "overwritten",
                   "gradient_accumulation_steps=1"),
    "packs_per_row": ({}, {"per_device_train_batch_size": 2}, {}, "per_device_train_batch_size=2",
                      "one pack's", "per_device_train_batch_size=1 (a larger max_length packs more tokens per step)"),
    "peft": (_peft, {}, {}, "a PEFT model (peft_config)", "peft adapters", None),
    "checkpointing": ({}, {"gradient_checkpointing": True}, {}, "gradient_checkpointing=True", "recomputation",
                      "gradient_checkpointing=False"),
    "compile_backend": ({}, {"torch_compile_backend": "aot_eager"}, {}, "torch_compile_backend='aot_eager'",
                        "inductor's", None),
    "logits": ({"loss_impl": "logits"}, {}, {}, "loss_impl='logits'", "fused linear CE", "loss_impl='auto'"),
    "eval_rows": (lambda p, t: {"eval_dataset": datasets.Dataset.from_list(rows(seed=1))},
                  {"per_device_eval_batch_size": 8}, {},
                  "an eval_dataset with per_device_eval_batch_size=8", "does not fit", "per_device_eval_batch_size=1"),
    "attention": ({}, {}, {"attn_backend": "reference"}, "attention backend 'reference'", "cu_seqlens on the host",
                  "attn_backend='auto'"),
    "float32": ({}, {}, {"dtype": torch.float32}, "float32 training", "float32 training", "bf16=True"),
    "vl": ({}, {}, None, "a vision-language model", "vision tower", None),
    "compile_off": ({"compile_layers": False}, {}, {}, "compile_layers=False", "replay the compiled layers", None),
}


def _conflict_trainer(tmp_path, tokenizer, name, **extra):  # noqa: F811
    trainer_kw, args_kw, model_kw, *_ = CONFLICTS[name]
    trainer_kw = trainer_kw(tmp_path, tokenizer) if callable(trainer_kw) else dict(trainer_kw)
    if model_kw is None:
        model = load_model("tiny-qwen3-vl", attn_backend="auto", dtype=torch.bfloat16)
        rows_ = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows()]
        for r in rows_:
            r["input_ids"] = [i % 100 for i in r["input_ids"]]
            r["labels"] = [i % 100 if i != -100 else -100 for i in r["labels"]]
        return VarpackSFTTrainer(
            model=model,
            args=trl_args(tmp_path, gradient_accumulation_steps=1, **args_kw),
            train_dataset=datasets.Dataset.from_list(rows_),
            processing_class=tokenizer,
            **trainer_kw,
            **extra,
        )
    return make(tmp_path, tokenizer, model=graph_model(**model_kw), args_kw=args_kw, **trainer_kw, **extra)


@pytest.mark.parametrize("name", sorted(CONFLICTS))
def test_each_conflict_falls_back_with_the_reason(tmp_path, tokenizer, on_cuda, name):  # noqa: F811
    *_, setting, fragment, fix = CONFLICTS[name]
    trainer = _conflict_trainer(tmp_path, tokenizer, name)
    assert not trainer.cuda_graphs and trainer.static_shape is None and on_cuda["graphs"] == []
    line = trainer.speed_line
    assert f"; CUDA graphs off (auto: {setting}" in line and fragment in line, line
    if fix is not None:
        assert line.endswith(f"; {fix} for them)"), line
    # the next fastest: compiled layers where varpack sft's auto compiles them (not beside peft), else eager
    compiled = name not in ("peft", "compile_off")
    assert len(on_cuda["compile"]) == int(compiled)
    assert line.startswith("regional torch.compile" if compiled else "eager"), line


@pytest.mark.parametrize("name", sorted(CONFLICTS))
def test_each_conflict_refuses_cuda_graphs_true(tmp_path, tokenizer, on_cuda, name):  # noqa: F811
    setting = CONFLICTS[name][3]
    with pytest.raises(ValueError, match="VarpackSFTTrainer: cuda_graphs=True with ") as info:
        _conflict_trainer(tmp_path, tokenizer, name, cuda_graphs=True)
    assert f"cuda_graphs=True with {setting}" in str(info.value), str(info.value)
    assert on_cuda["graphs"] == []
    # control: the same trainer without the conflict runs graphs with cuda_graphs=True
    assert make(tmp_path, tokenizer, cuda_graphs=True).cuda_graphs


def test_attention_that_cannot_be_captured_falls_back(tmp_path, tokenizer, on_cuda, monkeypatch):  # noqa: F811
    """The backend a captured layer would resolve to is asked for the model and the static shape; one that is not
    capturable (e.g. flex for a head dim FA4 does not train on this GPU) means no graphs, with its reason."""
    from varpack.integrations import cuda_graphs

    trainer = make(tmp_path, tokenizer)
    (asked,) = on_cuda["attention"]
    shape = trainer.static_shape
    assert asked["backend"] == "auto" and asked["dtype"] == torch.bfloat16
    assert asked["max_seqlen"] == shape.max_seqlen
    monkeypatch.setattr(cuda_graphs, "attention_refusal", lambda model, **k: "attention 'auto' resolves to flex")
    trainer = make(tmp_path, tokenizer)
    assert not trainer.cuda_graphs
    assert trainer.speed_line.endswith("; CUDA graphs off (auto: attention 'auto' resolves to flex)")
    with pytest.raises(ValueError, match="cuda_graphs=True with attention 'auto' resolves to flex"):
        make(tmp_path, tokenizer, cuda_graphs=True)


def test_auto_hands_the_captured_layers_to_triton_short(tmp_path, tokenizer, on_cuda, monkeypatch):  # noqa: F811
    """Where ``auto`` resolves outside the captured layers' backends (no FlashAttention-4: sdpa) and triton_short
    runs the model's heads (a verified head dim), the graphs stay on with triton_short as the model's attention,
    named on the speed line. A head dim triton_short is not checked at on the GPU falls back to no graphs."""
    from varpack.integrations import cuda_graphs

    why = "attention 'auto' resolves to sdpa here (head dim 64, bfloat16): captured layers need flash_attn_4 or triton_short"

    def refusal(model, *, backend, **k):
        return None if backend == "triton_short" else why

    monkeypatch.setattr(cuda_graphs, "attention_refusal", refusal)
    trainer = make(tmp_path, tokenizer, model=graph_model(config_overrides={"head_dim": 64}))
    assert trainer.cuda_graphs and len(on_cuda["graphs"]) == 1
    assert f"{GRAPHS_AUTO_REASON}; attention triton_short in the captured layers ({why})" in trainer.speed_line
    base = trainer.model
    assert base.config._attn_implementation == "varpack_triton_short"
    assert base._varpack_state.backend == "triton_short"
    # head dim 16 (tiny-qwen3's own): not among TRITON_SHORT_GRAPH_HEAD_DIMS, so no graphs, auto's reason named
    trainer = make(tmp_path, tokenizer, model=graph_model())
    assert not trainer.cuda_graphs and trainer.speed_line.endswith(f"; CUDA graphs off (auto: {why})")
    assert trainer.model.config._attn_implementation == "varpack"


def test_triton_short_hand_over_keeps_the_gated_delta_rule(tmp_path, tokenizer, on_cuda, monkeypatch):  # noqa: F811
    """A hybrid model whose Gated DeltaNet layers were patched with a named rule keeps it when the captured layers'
    attention is switched to triton_short (re-enabling varpack attention must not reset the rule to auto)."""
    from varpack.integrations import cuda_graphs
    from varpack.models.registry import is_gated_delta_layer

    monkeypatch.setattr(cuda_graphs, "model_refusal", lambda model, **k: None)  # a GPU where fla_hybrid runs
    monkeypatch.setattr(
        cuda_graphs, "attention_refusal", lambda model, *, backend, **k: None if backend == "triton_short" else "no"
    )
    model = graph_model(name="tiny-qwen3.5", gated_delta_backend="chunk", config_overrides={"head_dim": 64})
    trainer = make(tmp_path, tokenizer, model=model)
    assert trainer.cuda_graphs and trainer.model.config._attn_implementation == "varpack_triton_short"
    rules = {m._varpack_gdn_backend for m in trainer.model.modules() if is_gated_delta_layer(m)}
    assert rules == {"chunk"}


def test_attention_refusal_resolves_as_the_captured_layer(monkeypatch):
    """attention_refusal resolves the custom op's backend for the model's heads (with gradients, the op's
    exclusions): on the CPU auto reaches a backend that reads cu_seqlens on the host (refused, named);
    a resolution to flash_attn_4 (stood in) passes."""
    from varpack.attn import registry
    from varpack.integrations.cuda_graphs import GRAPH_BACKENDS, attention_refusal

    model = graph_model(config_overrides={"head_dim": 64})
    why = attention_refusal(model, backend="auto", device="cpu", dtype=torch.bfloat16, max_seqlen=300)
    assert why is not None and "resolves to" in why and "head dim 64, bfloat16" in why, why
    assert why.endswith("captured layers need flash_attn_4 or triton_short") and GRAPH_BACKENDS == (
        "flash_attn_4", "triton_short"
    )
    specs = []

    def resolved(name, spec, exclude=None):
        specs.append((name, spec, exclude))
        return registry.ResolvedBackend("flash_attn_4", "stood in")

    monkeypatch.setattr(registry, "resolve_spec", resolved)
    assert attention_refusal(model, backend="auto", device="cpu", dtype=torch.bfloat16, max_seqlen=300) is None
    (name, spec, exclude), = specs
    cfg = model.config
    assert name == "auto" and spec.needs_grad and spec.max_seqlen == 300 and spec.head_dim == 64
    assert (spec.num_heads, spec.num_kv_heads) == (cfg.num_attention_heads, cfg.num_key_value_heads)
    assert exclude  # the backends without a backward through the op are passed over


def test_trl_defaults_name_every_setting_to_change(tmp_path, tokenizer, on_cuda):  # noqa: F811
    """SFTConfig's defaults (8 packs per row, gradient checkpointing) on a CUDA run: compiled layers, the first
    conflict named, and the hint lists both settings that give CUDA graphs."""
    trainer = make(
        tmp_path, tokenizer, args_kw={"per_device_train_batch_size": 8, "gradient_checkpointing": True}
    )
    line = trainer.speed_line
    assert line.startswith("regional torch.compile") and "CUDA graphs off (auto: per_device_train_batch_size=8" in line
    assert line.endswith(
        "per_device_train_batch_size=1 (a larger max_length packs more tokens per step), "
        "gradient_checkpointing=False for them)"
    ), line


class _Args:
    """The trainer's SFTConfig with some attributes answered otherwise (``world_size`` is a property)."""

    def __init__(self, args, **over):
        self._args, self._over = args, over

    def __getattr__(self, name):
        return self._over[name] if name in self._over else getattr(self._args, name)


@pytest.mark.parametrize(
    ("attr", "value", "setting"),
    [
        ("world_size", 2, "2 processes"),
        ("is_fsdp_enabled", True, "FSDP"),
        ("is_deepspeed_enabled", True, "DeepSpeed"),
        ("use_liger_kernel", True, "use_liger_kernel=True"),
    ],
)
def test_engine_and_liger_conflicts(tmp_path, tokenizer, on_cuda, attr, value, setting):  # noqa: F811
    """Several processes, FSDP, DeepSpeed and Liger (which need a launcher or liger-kernel to construct):
    the choice on the constructed trainer with the setting answered otherwise."""
    trainer = make(tmp_path, tokenizer, cuda_graphs=False)
    on_cuda["compile"].clear()
    if attr.startswith("is_"):
        setattr(trainer, attr, value)
        args = trainer.args
    else:
        args = _Args(trainer.args, **{attr: value})
    graphs, layers = trainer._choose_step(args, "auto", "auto")
    assert not graphs.on and on_cuda["graphs"] == [] and len(on_cuda["compile"]) == int(layers.on)
    assert graphs.reason.startswith(f"auto: {setting}: "), graphs
    if attr == "use_liger_kernel":  # Liger's layers are eager (never compiled)
        assert not layers.on and layers.reason.startswith("auto: use_liger_kernel=True"), layers
    with pytest.raises(ValueError, match=f"cuda_graphs=True with {setting}"):
        trainer._choose_step(args, True, "auto")
    if attr == "use_liger_kernel":  # Liger and compiled layers are not combined: refused, naming both
        for given, forced in (("torch_compile=True", _Args(args, torch_compile=True)), ("compile_layers=True", args)):
            with pytest.raises(ValueError, match=f"{given} with use_liger_kernel=True"):
                trainer._choose_step(forced, "auto", True if given.startswith("compile") else "auto")
    if attr.startswith("is_"):
        setattr(trainer, attr, False)
    graphs, layers = trainer._choose_step(trainer.args, "auto", "auto")  # control: the trainer's own settings
    assert graphs.on and layers.on and graphs.reason == GRAPHS_AUTO_REASON


def test_trls_nan_filter_runs_on_the_device_and_copies_do_not_block(tmp_path, tokenizer, on_cuda, monkeypatch):  # noqa: F811
    """TRL's defaults (``logging_nan_inf_filter=True``, pinned batches) read nothing on the host per step:
    the filter moves to the device (tests/train/test_host_syncs.py) and a CUDA run's copies do not block;
    the user's ``args`` object is left as given."""
    args = trl_args(tmp_path, gradient_accumulation_steps=1, logging_nan_inf_filter=True, use_cpu=False)
    assert args.device.type == "cpu"  # resolved before CUDA is faked: the model stays on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert args.logging_nan_inf_filter and args.dataloader_pin_memory and not args.accelerator_config.non_blocking
    trainer = VarpackSFTTrainer(
        model=graph_model(), args=args, train_dataset=datasets.Dataset.from_list(rows()), processing_class=tokenizer
    )
    assert trainer.nan_inf_filter_on_device and not trainer.args.logging_nan_inf_filter
    assert trainer.args.accelerator_config.non_blocking and trainer.accelerator.dataloader_config.non_blocking
    assert args.logging_nan_inf_filter and not args.accelerator_config.non_blocking


def test_cpu_refuses_cuda_graphs_true(tmp_path, tokenizer):  # noqa: F811
    with pytest.raises(ValueError, match="cuda_graphs=True with a cpu run -- CUDA graphs need a CUDA GPU"):
        make(tmp_path, tokenizer, cuda_graphs=True)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"cuda_graphs": "yes"}, "cuda_graphs='yes'"),
        ({"compile_layers": 1.0}, "compile_layers=1.0"),
        ({"cuda_graphs": True, "compile_layers": False}, "cuda_graphs=True with compile_layers=False"),
        ({"args_kw": {"torch_compile_mode": "reduce-overhead"}}, "torch_compile_mode='reduce-overhead'"),
    ],
)
def test_bad_step_settings_are_refused(tmp_path, tokenizer, kw, match):  # noqa: F811
    with pytest.raises(ValueError, match=match):
        make(tmp_path, tokenizer, **kw)


def test_cuda_graphs_false_and_compile_off(tmp_path, tokenizer, on_cuda):  # noqa: F811
    trainer = make(tmp_path, tokenizer, cuda_graphs=False)
    assert not trainer.cuda_graphs and len(on_cuda["compile"]) == 1
    assert trainer.speed_line.endswith(
        "(auto on CUDA: fastest measured, benchmarks/RESULTS.md); "
        "the first step compiles every decoder layer (4-17 s for a 0.6B model on an H200); "
        "compile_layers=False to skip; CUDA graphs off (cuda_graphs=False)"
    ), trainer.speed_line
    trainer = make(tmp_path, tokenizer, cuda_graphs=False, compile_layers=False)
    assert len(on_cuda["compile"]) == 1
    assert trainer.speed_line == "eager + chunked linear CE (compile_layers=False); CUDA graphs off (cuda_graphs=False)"


# -- static shapes on the CPU: the same training, padded --------------------------------------------------------
def _losses_and_weights(trainer):
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("captured_attention", [None, "reference"])
def test_static_shapes_equal_the_dynamic_run(tmp_path, tokenizer, captured_attention, monkeypatch):  # noqa: F811
    """The graph step's collation on the CPU (eager layers): every row padded to one StaticShape of the train and
    eval plans; 3 optimizer steps (AdamW, 2 accumulation micro-batches) give the losses, weights and eval loss of
    the dynamic run; supervising the pad tokens (control) changes the loss. With the captured layers' attention
    known to take zero-length segments (``_graph_attention``) and EMPTY_PADS_BY_DEFAULT the pad segments may be
    empty (their negative control: tests/invariant/test_static_shapes.py)."""
    from varpack.integrations import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "EMPTY_PADS_BY_DEFAULT", True)
    eval_rows = datasets.Dataset.from_list(rows(lengths=(2, 2, 3, 2, 1, 2, 3, 2, 2), seed=3))

    def trainer(path):
        return VarpackSFTTrainer(
            model=tiny_model(),
            args=trl_args(tmp_path / path, per_device_eval_batch_size=1),
            train_dataset=datasets.Dataset.from_list(rows()),
            eval_dataset=eval_rows,
            processing_class=tokenizer,
            attn_backend="reference",
            pad_token_id=0,  # the pad tokens are embedded: an id of the tiny vocabulary
        )

    dynamic, static = trainer("dynamic"), trainer("static")
    if captured_attention is not None:
        static._graph_attention = (captured_attention, None)
    static._use_static_shape()
    shape = static.static_shape
    assert shape.empty_pads == (captured_attention is not None)
    eval_plan = static.eval_dataset.plan
    # the eval packs hold more samples than any train pack: the shape is the union's
    assert shape.segments == int(max(torch.tensor(p.offsets).diff().max() for p in (static.plan, eval_plan))) + 1
    assert shape.segments > int(torch.tensor(static.plan.offsets).diff().max()) + 1
    assert 0 < static.static_pad < 1
    for batch in [*static.get_train_dataloader(), *static.get_eval_dataloader()]:
        assert tuple(batch["input_ids"].shape) == (1, shape.tokens)
        assert batch["varlen_meta"].num_seqs == shape.segments
        assert batch["varlen_meta"].max_seqlen_q == shape.max_seqlen
    losses_d, weights_d = _losses_and_weights(dynamic)
    losses_s, weights_s = _losses_and_weights(static)
    assert len(losses_d) == len(losses_s) == 3
    assert_exact(losses_s, losses_d, rtol=LOSS_RTOL, what="loss")
    assert_exact(weights_s, weights_d)
    assert_exact(static.evaluate()["eval_loss"], dynamic.evaluate()["eval_loss"], rtol=LOSS_RTOL, what="eval")
    control = trainer("control")
    control._use_static_shape()  # pad segments of >= 2 tokens to supervise (zero-length ones have none)
    control.data_collator = _supervise_pads(control.data_collator)
    losses_c, _ = _losses_and_weights(control)
    assert_differs(losses_c, losses_d, rtol=LOSS_RTOL, what="loss")


# -- compiled layers on the CPU --------------------------------------------------------------------------------
def test_torch_compile_runs_compiled_layers_equal_to_eager(tmp_path, tokenizer):  # noqa: F811
    """TRL's torch_compile=True with torch_compile_backend="aot_eager" (traced, no code generation) on the CPU:
    every decoder layer compiled by varpack (not the whole model by transformers), the same losses as eager."""
    from accelerate.utils import DynamoBackend

    torch._dynamo.reset()
    compiled = make(
        tmp_path / "c",
        tokenizer,
        model=tiny_model(),
        attn_backend="reference",
        args_kw={"torch_compile": True, "torch_compile_backend": "aot_eager", "gradient_accumulation_steps": 2},
    )
    assert compiled.model._varpack_compiled["backend"] == "aot_eager"
    assert compiled.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
    assert compiled.speed_line.startswith(
        "regional torch.compile + chunked linear CE (torch_compile=True: varpack's compiled layers"
    ), compiled.speed_line
    eager = make(
        tmp_path / "e", tokenizer, model=tiny_model(), attn_backend="reference",
        args_kw={"gradient_accumulation_steps": 2},
    )
    assert not getattr(eager.model, "_varpack_compiled", None)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    got, _ = _losses_and_weights(compiled)
    assert counters["stats"]["unique_graphs"] > graphs  # the layers ran traced
    graphs = counters["stats"]["unique_graphs"]
    want, _ = _losses_and_weights(eager)
    assert counters["stats"]["unique_graphs"] == graphs  # and the eager drop-in traced nothing
    assert len(got) == 3
    assert_exact(got, want, rtol=LOSS_RTOL, what="loss")


# -- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_drop_in_runs_graphs_by_default(tmp_path, tokenizer):  # noqa: F811
    """The drop-in on tiny-qwen3 (head_dim 64, bf16 weights, attention auto), one CUDA GPU, no step keyword:
    static shapes + CUDA graphs (speed line; no graph skipped), losses and eval loss equal to the eager drop-in
    (cuda_graphs=False, compile_layers=False) within bf16 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine)")
    from varpack.integrations.cuda_graphs import cudagraph_skips

    def run(path, **kw):
        torch._dynamo.reset()
        model = load_model(
            "tiny-qwen3", dtype=torch.bfloat16, attn_backend="auto", config_overrides={"head_dim": 64}, seed=0
        )
        args = trl_args(
            tmp_path / path,
            max_length=1024,
            gradient_accumulation_steps=1,
            max_steps=4,
            learning_rate=1e-3,
            per_device_eval_batch_size=1,
            use_cpu=False,
            bf16=False,
        )
        g = torch.Generator().manual_seed(0)
        data = [
            {"input_ids": (ids := torch.randint(0, 1000, (n,), generator=g).tolist()), "labels": ids}
            for n in torch.randint(130, 500, (48,), generator=g).tolist()  # max_seqlen > 128: FA4's class
        ]
        trainer = VarpackSFTTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(data[:40]),
            eval_dataset=datasets.Dataset.from_list(data[40:]),
            processing_class=tokenizer,
            **kw,
        )
        losses, _ = _losses_and_weights(trainer)
        return trainer, losses, trainer.evaluate()["eval_loss"]

    before = cudagraph_skips()
    graphs, losses_g, eval_g = run("graphs")
    assert cudagraph_skips() == before
    assert graphs.cuda_graphs and graphs.speed_line.startswith("static shapes T="), graphs.speed_line
    assert "CUDA graphs per layer" in graphs.speed_line and "(auto on one CUDA GPU" in graphs.speed_line
    eager, losses_e, eval_e = run("eager", cuda_graphs=False, compile_layers=False)
    assert eager.speed_line.startswith("eager + chunked linear CE"), eager.speed_line
    assert len(losses_g) == len(losses_e) == 4
    torch.testing.assert_close(losses_g, losses_e, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(eval_g, eval_e, rtol=2e-2, atol=2e-2)


def test_liger_is_mapped_to_the_compiled_step(tmp_path, tokenizer, on_cuda, monkeypatch):  # noqa: F811
    """TRL's ``use_liger_kernel=True`` asks for fused layers: where the step compiles the layers (here the CUDA
    graphs, device answered "cuda") they take Liger's place -- neither TRL nor ``Trainer.train`` (which applies
    Liger when ``args.use_liger_kernel`` is set; inside captured layers Liger's RoPE failed on the H200) is asked
    to apply it, the speed line says so; where the layers stay eager (``compile_layers=False``),
    ``args.use_liger_kernel`` stays set, so ``Trainer.train`` applies Liger's layers. Control: ``compile_layers=True`` with Liger is still refused by name; off CUDA, Liger is refused."""
    trainer = make(tmp_path, tokenizer, args_kw={"use_liger_kernel": True})
    assert trainer.graph_choice.on and trainer.step_choice.on and not trainer.liger_applied
    assert "use_liger_kernel=True: varpack's compiled layers in place of Liger-Kernel's" in trainer.speed_line
    assert trainer.args.use_liger_kernel is False  # as run: Trainer.train() must not apply Liger
    eager = make(tmp_path, tokenizer, args_kw={"use_liger_kernel": True}, compile_layers=False)
    assert not eager.step_choice.on and eager.liger_applied and eager.args.use_liger_kernel is True
    assert "Liger-Kernel layers" in eager.speed_line, eager.speed_line
    with pytest.raises(ValueError, match="compile_layers=True with use_liger_kernel=True"):
        make(tmp_path, tokenizer, args_kw={"use_liger_kernel": True}, compile_layers=True)
    monkeypatch.setattr(trl_module, "_device_type", lambda args: "cpu")
    with pytest.raises(ValueError, match="use_liger_kernel=True -- .* this run trains on cpu"):
        make(tmp_path, tokenizer, args_kw={"use_liger_kernel": True}, compile_layers=False)
