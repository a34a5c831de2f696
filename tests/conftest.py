import functools
import os
import sys

import numpy as np
import pytest
import torch

# Triton runs interpreted (NumPy, CPU tensors) only when TRITON_INTERPRET=1 is set before triton is imported,
# and then for the whole process; torch._dynamo imports triton as soon as it loads (while test modules are
# collected). On a machine without CUDA no compiled Triton kernel can run anyway, so the variable is set here,
# first: the Triton kernels of varpack (the triton_short attention backend) are then tested on the CPU
# (tests/attn/test_triton_short.py). On a GPU machine nothing changes.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---------------------------------------------------------------------------------------------------------
# the GPU suite in two shards (README "Development"; scripts/gpu.sh tests:1 / tests:2)
# ---------------------------------------------------------------------------------------------------------
#: Every ``gpu`` test belongs to one shard, by the longest node-id prefix below: ``pytest -m gpu_shard1 tests``
#: and ``pytest -m gpu_shard2 tests`` together run ``pytest -m gpu tests``. Shard 1 holds the attention kernels
#: and the compiled / captured steps (it needs flash-attn-4 to run its FA4 cases); shard 2 the gated delta rule,
#: fla and the linear-attention models (it needs fla, not FA4). A gpu test in a file not listed here stops the
#: collection, naming the file. The split follows the tests' cold-machine cost: Triton / inductor / FA4 compiles
#: and fla's first-use autotuning (minutes per head shape and dtype on a cold machine: benchmarks/RESULTS.md#hybrid-step), which is why each
#: fla head shape's tests share a group below.
GPU_SHARDS: dict[str, int] = {
    "tests/attn/": 1,
    "tests/integrations/": 1,
    "tests/train/": 1,
    "tests/ops/test_custom_ops.py": 1,
    "tests/ops/test_linear_ce.py": 1,
    "tests/ops/test_linear_ce_supervised_rows.py": 1,
    "tests/ops/test_linear_ce_liger_kernel.py": 1,
    "tests/ops/test_dqkwg_triton.py": 1,
    "tests/invariant/test_autocast.py": 1,
    "tests/invariant/test_compile_and_liger.py": 1,
    "tests/invariant/test_static_shapes.py": 1,
    "tests/test_check.py::test_gpu_check_bf16_auto": 1,
    "tests/ops/test_fla_hybrid.py": 2,
    "tests/ops/test_gated_delta_rule.py": 2,
    "tests/ops/test_short_conv.py": 2,
    "tests/ops/test_short_conv_triton.py": 2,
    "tests/invariant/test_gated_delta.py": 2,
    "tests/invariant/test_compiled_gated_delta.py": 2,
    "tests/invariant/test_vision_language_gpu.py": 2,
    "tests/invariant/test_mamba2.py": 2,
    "tests/ops/test_ssd.py": 2,
    "tests/test_check.py::test_gpu_check_tiny_qwen35": 2,
}
#: pytest-xdist groups (``-n N --dist loadgroup``; scripts/gpu.sh): one process runs a group's tests in order,
#: so what they compile or autotune is paid once. Default group: the test's file; these node-id prefixes get
#: their own group (a group of its own runs beside the rest of its file: the longest groups set a shard's time).
GPU_GROUPS: dict[str, str] = {
    "tests/ops/test_fla_hybrid.py::test_gpu_fla_hybrid_no_initial_state_equal_heads": "fla-equal-heads",
    "tests/ops/test_fla_hybrid.py::test_gpu_fla_hybrid_70000_one_token_sequences": "fla-70000",
    "tests/attn/test_triton_short_gpu.py::test_pack_gqa_matches_reference": "triton-short-pack-gqa",
}


def _longest_prefix(nodeid: str, table: dict):
    keys = [k for k in table if nodeid.startswith(k)]
    return table[max(keys, key=len)] if keys else None


def gpu_shard(nodeid: str) -> int | None:
    """The shard (1 or 2) of a gpu test's node id (relative to the repository root), None when unlisted."""
    return _longest_prefix(nodeid, GPU_SHARDS)


def gpu_group(item) -> str:
    """The xdist group of a gpu test: :data:`GPU_GROUPS`, else its file; tests/attn/test_attn_gpu.py's
    parametrized tests by backend (each backend's compiles stay in one process)."""
    group = _longest_prefix(item.nodeid, GPU_GROUPS)
    if group is not None:
        return group
    path = item.nodeid.split("::")[0]
    backend = getattr(item, "callspec", None) and item.callspec.params.get("backend")
    return f"{path}:{backend}" if path == "tests/attn/test_attn_gpu.py" and backend else path


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection, which reads the shard markers
def pytest_collection_modifyitems(config, items):
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if "gpu" not in item.keywords:
            continue
        shard = gpu_shard(item.nodeid)
        if shard is None:
            raise pytest.UsageError(
                f"{item.nodeid.split('::')[0]}: a gpu test in no GPU shard; add its file to GPU_SHARDS in "
                "tests/conftest.py"
            )
        item.add_marker(f"gpu_shard{shard}")
        if xdist:
            item.add_marker(pytest.mark.xdist_group(gpu_group(item)))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _attention_registry_restored():
    """A backend a test registers (a benchmark's ``no_kernel``, a fake) is gone before the next test: the
    registry is what ``--attn-backend`` offers and what ``auto`` chooses from."""
    from varpack.attn import registry

    before = dict(registry.BACKENDS)
    yield
    if registry.BACKENDS != before:
        registry.BACKENDS.clear()
        registry.BACKENDS.update(before)


# ---------------------------------------------------------------------------------------------------------
# uninitialised memory must not pass a test
# ---------------------------------------------------------------------------------------------------------
def _poison(t):
    """Fill a freshly allocated tensor in place: NaN for float / complex, the dtype's max for integers, True
    for bool (other dtypes, e.g. quantized, are left as allocated). Returns ``t``."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return t
    dtype = t.dtype
    if dtype.is_floating_point or dtype.is_complex:
        value = float("nan")
    elif dtype == torch.bool:
        value = True
    else:
        try:
            value = torch.iinfo(dtype).max
        except TypeError:
            return t
    with torch.no_grad():
        t.fill_(value)
    return t


def _poison_np(a):
    """The NumPy twin of :func:`_poison` (object and other dtypes are left as allocated)."""
    if not isinstance(a, np.ndarray) or a.size == 0:
        return a
    kind = a.dtype.kind
    if kind in "fc":
        a.fill(np.nan)
    elif kind == "b":
        a.fill(True)
    elif kind in "iu":
        a.fill(np.iinfo(a.dtype).max)
    return a


def _poisoned(fn, poison=_poison):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return poison(fn(*args, **kwargs))

    wrapper.__varpack_poisoned__ = True
    return wrapper


@pytest.fixture(autouse=True)
def _nan_fill_uninitialised(request, monkeypatch):
    """``torch.empty`` / ``torch.empty_like`` / ``torch.empty_strided`` / ``Tensor.new_empty`` (and NumPy's
    ``np.empty`` / ``np.empty_like``) return arrays filled with NaN (floats) or the dtype's max (integers) in
    every test, so code that reads memory it never wrote fails instead of passing on whatever the allocator
    left there. Python-level calls through the module attribute only (torch's C++ internals, and a name bound
    by ``from torch import empty`` before the test, allocate without this). Opt out with
    ``@pytest.mark.uninitialised_ok`` (say why)."""
    if request.node.get_closest_marker("uninitialised_ok") is not None:
        yield
        return
    for owner, name, wrapper in _POISONED:
        monkeypatch.setattr(owner, name, wrapper)
    yield


# Built once and kept alive for the whole test run: torch._dynamo caches the id() of every function it finds in
# torch / numpy's namespaces, so a per-test wrapper, freed after the test, could lend its id to a later
# function (e.g. a flex_attention mask_mod) that dynamo would then mistake for a numpy function.
_POISONED = [
    (torch, "empty", _poisoned(torch.empty)),
    (torch, "empty_like", _poisoned(torch.empty_like)),
    (torch, "empty_strided", _poisoned(torch.empty_strided)),
    (torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty)),
    (np, "empty", _poisoned(np.empty, _poison_np)),
    (np, "empty_like", _poisoned(np.empty_like, _poison_np)),
]
