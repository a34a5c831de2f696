"""close_process_group: a DDP model kept alive only by a reference cycle is freed while the group is still
registered, then the group is destroyed; nothing happens without a group."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist

from varpack.train.distributed import close_process_group


class _Cycle:
    def __init__(self, model):
        self.model, self.me = model, self  # a Trainer-like holder that only the cycle collector frees


def test_cycle_held_ddp_model_is_freed_before_the_group_is_destroyed(tmp_path, monkeypatch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        ddp(torch.ones(2, 4)).sum().backward()  # the Reducer has run its all-reduce
        alive = weakref.ref(ddp)
        _Cycle(ddp)
        del ddp
        gc.disable()  # no automatic collection in between: only close_process_group's own may free the cycle
        seen = []
        destroy = dist.destroy_process_group
        monkeypatch.setattr(dist, "destroy_process_group", lambda: (seen.append(alive()), destroy())[1])
        assert alive() is not None
        close_process_group()
        assert seen == [None]  # the wrapped model was gone when the group was destroyed
        assert not dist.is_initialized()
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_order_check_can_fail(tmp_path, monkeypatch):
    """Negative control: without the collection the cycle-held model is still alive at destroy time."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        alive = weakref.ref(ddp)
        _Cycle(ddp)
        del ddp
        gc.disable()
        monkeypatch.setattr(gc, "collect", lambda *a: 0)
        seen = []
        destroy = dist.destroy_process_group
        monkeypatch.setattr(dist, "destroy_process_group", lambda: (seen.append(alive()), destroy())[1])
        close_process_group()
        assert seen[0] is not None
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_nothing_without_a_group():
    assert not dist.is_initialized()
    close_process_group()
    assert not dist.is_initialized()
