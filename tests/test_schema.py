"""varpack.schema: the one place the sample/batch field names live."""

import inspect
import subprocess
import sys

import torch.nn.functional as F

from varpack import schema
from varpack.collate import PaddingFreeCollator


def test_ignore_index_is_torch_cross_entropy_default():
    assert schema.IGNORE_INDEX == inspect.signature(F.cross_entropy).parameters["ignore_index"].default


def test_schema_imports_nothing_heavy():
    code = "import sys, varpack.schema; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_collated_batch_keys_are_declared_in_schema():
    """Every key the collator emits is a schema name (a new key must be added to varpack.schema first)."""
    pack = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "loss_scale": [1.0, 1.0, 0.5], "sample_id": 0},
        {"input_ids": [4, 5], "labels": [-100, 5], "loss_scale": [1.0, 1.0], "sample_id": 1},
    ]
    batch = PaddingFreeCollator()([pack])
    declared = (
        set(schema.TOKEN_ALIGNED_FIELDS)
        | set(schema.BOUNDARY_KEYS)
        | set(schema.MEDIA_FIELDS)
        | {schema.SAMPLE_IDS}
    )
    assert set(batch) <= declared, set(batch) - declared
    # the boundary view transformers reads, and the non-model split, are both present
    assert set(schema.BOUNDARY_KEYS) <= set(batch)
    model_inputs = {k for k in batch if k not in schema.NOT_MODEL_INPUTS}
    assert schema.LABELS not in model_inputs and schema.LOSS_SCALE not in model_inputs
    assert schema.INPUT_IDS in model_inputs


def test_derived_groups_are_consistent():
    assert set(schema.TOKEN_FIELDS) < set(schema.FLAT_TOKEN_FIELDS) < set(schema.TOKEN_ALIGNED_FIELDS)
    assert schema.POSITION_IDS not in schema.FLAT_TOKEN_FIELDS
    for pixels, grid in schema.MEDIA_PAIRS:
        assert pixels in schema.MEDIA_FIELDS and grid in schema.MEDIA_FIELDS
    assert set(schema.FLASH_ATTN_KWARGS) < set(schema.BOUNDARY_KEYS)
    assert not set(schema.NOT_MODEL_INPUTS) & set(schema.BOUNDARY_KEYS)
    assert set(schema.__all__) == {n for n in dir(schema) if n.isupper()}
