"""Probe once, remember the answer: the one availability mechanism of varpack's backends.

Every optional fast path (an attention library, fla's Triton kernels, Liger-Kernel's fused loss) is checked
the same way before it is chosen: a *probe* answers ``(ok, reason)`` -- or a small record of such pairs when
one check decides several capabilities (fla's forward and backward) -- and the answer is cached per key
(the device, a dtype, ...), so the check runs once per process and key, not per call or per layer. Callers
pick a backend from the cached answers and report the reason; a forced backend that failed its probe raises
with that reason, ``auto`` skips it.

:class:`ProbeOnce` is the cache (a decorator through :func:`probe_once`); :func:`reset_probes` forgets every
answer (tests that change the environment, e.g. ``VARPACK_DISABLE_FLA``, call it).

Users: :meth:`varpack.attn._base.Backend.is_available` (one probe per attention backend object),
:func:`varpack.ops.gated_delta_rule.dispatch.fla_gated_delta_status` and
:func:`varpack.ops.short_conv.fla_conv_status` (one forward + backward check of fla per device), and
:func:`varpack.ops.linear_ce.liger._liger_probe` (Liger-Kernel importable, and with which features).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["ProbeOnce", "probe_failed", "probe_once", "reset_probes"]

R = TypeVar("R")

_ALL: weakref.WeakSet[ProbeOnce[Any]] = weakref.WeakSet()


def probe_failed(exc: BaseException) -> tuple[bool, str]:
    """The answer of a probe that raised: ``(False, "probe failed: <Type>: <message>")`` (a broken install
    must not break dispatch; the reason names what failed)."""
    return False, f"probe failed: {type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _probe_modes() -> Iterator[None]:
    """Autograd on, inference mode off, while a probe runs: a probe checks a backward (fla's gated delta
    rule and short conv run ``torch.autograd.grad``), and its answer is cached for every later caller, so
    it must not depend on the grad mode of the first caller (a forward under ``torch.no_grad()`` or
    ``torch.inference_mode()``, e.g. an evaluation, would otherwise make the probe itself fail)."""
    import torch

    with torch.inference_mode(False), torch.enable_grad():
        yield


class ProbeOnce(Generic[R]):
    """Run ``probe(*args)`` once per key and cache its answer (thread-safe; other callers wait for it).

    The probe runs with autograd enabled and outside inference mode whatever the caller's modes (the
    answer is shared by every later caller).

    Args:
        probe: the check; returns ``(ok, reason)`` (or a record of such pairs). Called with the arguments
            given to the :class:`ProbeOnce`.
        key: maps the call's arguments to the cache key; default: the positional arguments themselves.
        on_error: turns an exception raised by ``probe`` into a cached answer (e.g. :func:`probe_failed`);
            ``None``: the exception propagates and nothing is cached (the next call probes again).
        name: shown in ``repr``.
    """

    def __init__(
        self,
        probe: Callable[..., R],
        *,
        key: Callable[..., Hashable] | None = None,
        on_error: Callable[[Exception], R] | None = None,
        name: str | None = None,
    ) -> None:
        self.probe = probe
        self.key = key
        self.on_error = on_error
        self.name = name or getattr(probe, "__qualname__", repr(probe))
        self._answers: dict[Hashable, R] = {}
        self._lock = threading.RLock()
        functools.update_wrapper(self, probe, updated=())
        _ALL.add(self)

    def __call__(self, *args: Any) -> R:
        key = self.key(*args) if self.key is not None else args
        with self._lock:
            if key not in self._answers:
                try:
                    with _probe_modes():
                        answer = self.probe(*args)
                except Exception as exc:
                    if self.on_error is None:
                        raise
                    answer = self.on_error(exc)
                self._answers[key] = answer
            return self._answers[key]

    def answers(self) -> dict[Hashable, R]:
        """A copy of the cached answers, by key."""
        with self._lock:
            return dict(self._answers)

    def reset(self) -> None:
        """Forget every cached answer: the next call probes again."""
        with self._lock:
            self._answers.clear()

    def __repr__(self) -> str:
        return f"<ProbeOnce {self.name} ({len(self._answers)} cached)>"


def probe_once(
    probe: Callable[..., R] | None = None,
    *,
    key: Callable[..., Hashable] | None = None,
    on_error: Callable[[Exception], R] | None = None,
):
    """Decorator form of :class:`ProbeOnce`: ``@probe_once`` or ``@probe_once(key=..., on_error=...)``."""

    def wrap(fn: Callable[..., R]) -> ProbeOnce[R]:
        return ProbeOnce(fn, key=key, on_error=on_error)

    return wrap(probe) if probe is not None else wrap


def reset_probes() -> None:
    """Forget the answers of every :class:`ProbeOnce` of the process (tests that change the environment)."""
    for probe in list(_ALL):
        probe.reset()
