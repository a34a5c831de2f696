"""`describe_engine`: the data-parallel engine a run reports, read from the wrapped model."""

from __future__ import annotations

import torch

from varpack.train.trainer import describe_engine


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def test_single_process_and_ddp_names():
    assert describe_engine(_model(), 1) == "single process"
    assert describe_engine(_model(), 2, "MULTI_GPU") == "DDP on 2 ranks"
    assert describe_engine(_model(), 4, "MULTI_CPU") == "DDP on 4 ranks"
    assert describe_engine(_model(), 2, "FSDP") == "FSDP1 (accelerate) on 2 ranks"
    assert describe_engine(_model(), 2, "XLA") == "XLA data parallel on 2 ranks"


def test_fully_sharded_units_are_counted():
    """FSDP2 is read off the modules (``fully_shard`` swaps their class to an ``FSDPModule`` subclass), not
    off a flag: mark two modules the way ``fully_shard`` does and they are counted."""
    from torch.distributed.fsdp import FSDPModule

    model = _model()
    for m in (model[0], model):
        m.__class__ = type(f"FSDP{type(m).__name__}", (FSDPModule, type(m)), {})
    assert describe_engine(model, 2, "MULTI_GPU") == "FSDP2 (fully_shard, 2 units) on 2 ranks"
    assert describe_engine(_model(), 2, "MULTI_GPU") == "DDP on 2 ranks"  # negative control: unsharded
