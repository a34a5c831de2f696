"""The vision-language benchmark shape packs exactly: ``qwen3.5-vl-hybrid-shape`` cut to 4 language layers (3
Gated DeltaNet, 1 full attention, at the real head sizes: 16 heads of 128, attention head dim 256 with the
[11, 11, 10] mRoPE split) and one vision layer, real images through the Qwen3.5 vocabulary's placeholders,
float32 on the CPU: :func:`varpack.check.check_exactness` (packed == per sample: logits, loss, every gradient).
The family's negative controls (mRoPE planes, boundaries, media order) are in test_vision_language.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("skimage")

from varpack.check import check_exactness  # noqa: E402
from varpack.data.load import load_and_encode  # noqa: E402
from varpack.data.vl_builtin import write_vl_jsonl  # noqa: E402
from varpack.models import load_model  # noqa: E402
from varpack.models.load import load_tokenizer_for  # noqa: E402

NAME = "qwen3.5-vl-hybrid-shape"


def test_vl_hybrid_shape_packed_equals_per_sample_fp32(tmp_path):
    model = load_model(NAME, config_overrides={"num_hidden_layers": 4, "vision_config": {"depth": 1}})
    path = write_vl_jsonl(tmp_path / "vl.jsonl", limit=2)  # two image chats and the text chats between them
    samples = list(load_and_encode([path], load_tokenizer_for(NAME), rope_model=lambda: model, num_proc=1).samples)[:3]
    image_id = model.config.image_token_id
    assert sum(int((torch.as_tensor(s["input_ids"]) == image_id).sum()) > 0 for s in samples) == 2
    result = check_exactness(model, samples, dtype=torch.float32)
    assert result["passed"], result["failures"]
    assert result["num_samples"] == 3 and result["max_abs_logit_diff"] < result["tolerance"]["logits_atol"]
