"""The GPU suite's two shards (tests/conftest.py GPU_SHARDS): every file with gpu tests is in one, and
``-m gpu_shard1`` / ``-m gpu_shard2`` together select exactly ``-m gpu``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import GPU_GROUPS, GPU_SHARDS, gpu_shard

TESTS = Path(__file__).resolve().parent
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b|pytestmark = pytest\.mark\.gpu")


def _gpu_files():
    return sorted(
        p.relative_to(TESTS.parent).as_posix()
        for p in TESTS.rglob("test_*.py")
        if GPU_MARK.search(p.read_text(encoding="utf-8"))
    )


def test_every_gpu_test_file_is_in_a_shard():
    files = _gpu_files()
    assert len(files) >= 10, files
    unlisted = [f for f in files if not any(k.split("::")[0] == f or f.startswith(k) for k in GPU_SHARDS)]
    assert not unlisted, f"gpu tests in no shard (tests/conftest.py GPU_SHARDS): {unlisted}"
    assert set(GPU_SHARDS.values()) == {1, 2}
    for key in [*GPU_SHARDS, *GPU_GROUPS]:  # no stale entry
        path = TESTS.parent / key.split("::")[0]
        assert path.exists(), key
        if "::" in key:
            assert f"def {key.split('::')[1]}" in path.read_text(encoding="utf-8"), key


def test_shard_of_a_node_id_is_its_longest_prefix():
    assert gpu_shard("tests/attn/test_attn_gpu.py::test_no_host_sync_per_layer[flex]") == 1
    assert gpu_shard("tests/test_check.py::test_gpu_check_bf16_auto[tiny-qwen3]") == 1
    assert gpu_shard("tests/test_check.py::test_gpu_check_tiny_qwen35_bf16_gated_delta_on_fla_kernels") == 2
    assert gpu_shard("tests/test_check.py::test_check_passes") is None
    assert gpu_shard("tests/ops/test_fla_hybrid.py::test_gpu_fla_hybrid_70000_one_token_sequences") == 2


class _Item:
    def __init__(self, nodeid, gpu=True):
        self.nodeid, self.keywords, self.marks = nodeid, {"gpu": 1} if gpu else {}, []

    def add_marker(self, mark):
        self.marks.append(mark if isinstance(mark, str) else mark.name)


class _Config:
    class pluginmanager:  # noqa: N801 (the attribute pytest's config has)
        @staticmethod
        def hasplugin(name):
            return False


def test_collection_marks_the_shard_and_refuses_a_gpu_test_in_no_shard(monkeypatch):
    import tests.conftest as conftest

    monkeypatch.setattr(conftest.torch.cuda, "is_available", lambda: True)  # no skip markers in the way
    items = [_Item("tests/ops/test_linear_ce.py::test_gpu_peak_memory_below_unfused"), _Item("tests/x.py::t", False)]
    conftest.pytest_collection_modifyitems(_Config(), items)
    assert items[0].marks == ["gpu_shard1"] and items[1].marks == []
    with pytest.raises(pytest.UsageError, match=r"tests/ops/test_new_kernel.py: a gpu test in no GPU shard"):
        conftest.pytest_collection_modifyitems(_Config(), [_Item("tests/ops/test_new_kernel.py::test_k")])
