"""Streaming source: chats read lazily, encoded on the fly, packed online (``varpack sft --streaming``).

- :class:`ChatStream`: a re-iterable source of rows, each with its index in the stream (its ``sample_id``):
  JSON Lines files read line by line (plain or ``.gz``), a Hugging Face ``datasets.IterableDataset``
  (``load_dataset(..., streaming=True)``) or ``Dataset``, a list of rows, or a function of no arguments that
  returns a fresh iterator (a generator function). A row is a chat in any format of
  :mod:`varpack.data.formats` (encoded with the tokenizer's chat template by
  :func:`varpack.data.chat.encode_chat`), or an already encoded sample (``input_ids``, ``labels``, optional
  ``length``; docs/ARCHITECTURE.md "Encoded sample"), taken as is.
- :class:`StreamingPackedDataset`: a ``torch.utils.data.IterableDataset`` that encodes the rows of its shard
  as they are read, packs them with :class:`varpack.plan.streaming.StreamingPacker` (best-fit decreasing over
  a bounded buffer) and yields packs: lists of sample dicts, exactly like an item of
  :class:`varpack.data.dataset.PackedDataset` (so ``PaddingFreeCollator`` and the Trainer's collator take
  them), or collated batches when given a ``collator``.

Sharding. Sample ``i`` (its index in the stream) belongs to shard ``i % S`` with ``S = world_size *
num_workers`` and shard ``rank * num_workers + worker_id`` (``torch.utils.data.get_worker_info()``): each
sample is read, encoded and packed in exactly one rank and one DataLoader worker per pass; every shard runs
its own packer and emits its leftovers at the end of its part of the stream. The shard of a rank is decided
by the sample index alone, so it does not depend on timing.

Resuming. :meth:`StreamingPackedDataset.state_dict` after ``k`` packs were taken from an iterator holds the
stream position, the packer's state (buffered sample ids, counters, report) and the packs already planned
but not yet yielded; a fresh dataset given it by :meth:`~StreamingPackedDataset.load_state_dict` yields
exactly the packs that the uninterrupted pass would have yielded next (the buffered samples are read and
encoded again from the source: the state holds ids, not tokens). In a DataLoader worker the state lives in
the worker's copy: torchdata's ``StatefulDataLoader`` (accelerate's ``use_stateful_dataloader``) asks every
worker for it; with a plain DataLoader take the state with ``num_workers=0``. Asked in the main process
after workers started reading the stream, :meth:`~StreamingPackedDataset.state_dict` raises instead of
returning the main process's stale copy (the workers count their passes in memory shared with it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from varpack.data.dataset import cut_piece, supervised_ranges
from varpack.data.jsonfile import iter_lines, location, parse_line, require_file
from varpack.plan.streaming import DEFAULT_BUFFER_SIZE, PackBatch, StreamingPacker
from varpack.schema import TOKEN_ALIGNED_FIELDS

__all__ = ["ChatStream", "StreamingPackedDataset"]

_FORMAT = "varpack-stream/1"
#: the most overlong / left-out samples a pass remembers the FILE:LINE of, for its report (which names 10)
MAX_REPORTED_LOCATIONS = 100
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")


class ChatStream:
    """A re-iterable stream of rows; row ``i`` has ``sample_id`` ``i`` (module docstring for the sources).

    Args:
        source: JSONL path(s) (``.jsonl`` / ``.ndjson``, optionally ``.gz``), a ``datasets.IterableDataset``
            or ``datasets.Dataset``, a sequence of row dicts, or a function of no arguments returning an
            iterator of row dicts (called once per pass and per DataLoader worker).
        label: how reports name the source (default: the file names, or the source's type).

    Raises:
        FileNotFoundError: a path does not exist.
        IsADirectoryError: a path is a directory (give its files).
        ValueError: a file that is not JSON Lines (``.json`` / parquet: use the non-streaming path, or give
            a ``datasets`` streaming dataset).
        TypeError: a one-shot iterator (a generator object): pass the generator function instead, so that
            every pass and every worker can read the stream from its start.
    """

    def __init__(self, source: Any, *, label: str | None = None) -> None:
        self._label = label
        self.paths: tuple[str, ...] = ()
        if isinstance(source, (str, os.PathLike)):
            source = [source]
        if isinstance(source, Sequence) and source and all(isinstance(p, (str, os.PathLike)) for p in source):
            paths = []
            for p in source:
                require_file(p)
                path = Path(p).expanduser()
                if not path.name.lower().endswith(_JSONL_SUFFIXES):
                    raise ValueError(
                        f"{os.fspath(p)!r}: streaming reads JSON Lines files (.jsonl, .ndjson, optionally .gz) "
                        "line by line; convert it, or pass datasets.load_dataset(..., streaming=True)"
                    )
                paths.append(str(path))
            self.paths = tuple(paths)
            self.source: Any = None
        elif isinstance(source, Iterator):
            raise TypeError(
                "ChatStream needs a source it can read again from the start (every pass, every DataLoader "
                "worker, a resume): pass the generator function, not the generator object"
            )
        elif callable(source) or _is_hf(source) or isinstance(source, Sequence):
            self.source = source
        else:
            raise TypeError(
                f"ChatStream source must be JSONL path(s), a datasets (Iterable)Dataset, a list of rows or a "
                f"function returning an iterator of rows; got {type(source).__name__}"
            )

    @property
    def label(self) -> str:
        """The label given, else the file names or the source's type (for reports)."""
        if self._label:
            return self._label
        return ", ".join(self.paths) if self.paths else type(self.source).__name__

    def rows(
        self,
        *,
        shard: int = 0,
        num_shards: int = 1,
        wanted: Callable[[int], bool] | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> Iterator[tuple[int, Any]]:
        """``(sample_id, row)`` of the rows ``i`` in ``[start, stop)`` with ``i % num_shards == shard`` (and
        ``wanted(i)`` when given), in stream order. Rows of other shards are skipped unparsed (JSONL).

        Raises:
            ValueError: a line that is not UTF-8 text, not JSON or not a JSON object (naming ``FILE:LINE`` and
                the sample id, :mod:`varpack.data.jsonfile`).
        """
        for i, raw, where in self._raw(start):
            if stop is not None and i >= stop:
                return
            if i % num_shards != shard or (wanted is not None and not wanted(i)):
                continue
            if isinstance(raw, (str, bytes)):
                row = parse_line(raw, f"{where}: sample {i}")  # not UTF-8 / not JSON: named
                if not isinstance(row, dict):
                    raise ValueError(
                        f"{where}: sample {i}: a JSON Lines row must be an object, got {row!r:.60}"
                    )
                yield i, _Located(row, where)
            else:
                yield i, raw

    def _raw(self, start: int) -> Iterator[tuple[int, Any, str | None]]:
        """Every row from the start: ``(index, raw line or row, location)``; indices below ``start`` are
        counted but not returned."""
        i = 0
        if self.paths:
            for path in self.paths:
                for sid, lineno, line in iter_lines(path, first_sample=i):
                    if sid >= start:
                        yield sid, line, location(path, lineno)
                    i = sid + 1
            return
        src = self.source
        if _is_hf(src):
            import datasets

            if isinstance(src, datasets.Dataset):
                it: Iterable[Any] = (src[j] for j in range(start, len(src)))
                i = start
            else:  # .iter() reads every row, also inside a DataLoader worker (__iter__ would shard by file)
                it = (
                    {k: v[j] for k, v in batch.items()}
                    for batch in src.iter(batch_size=256)
                    for j in range(len(next(iter(batch.values()))) if batch else 0)
                )
        elif isinstance(src, Sequence):
            it = (src[j] for j in range(start, len(src)))
            i = start
        else:
            it = src()
        for row in it:
            if i >= start:
                yield i, row, None
            i += 1


class _Located(dict):
    """A row dict that remembers its ``FILE:LINE`` (for errors)."""

    __slots__ = ("where",)

    def __init__(self, row: dict[str, Any], where: str | None) -> None:
        super().__init__(row)
        self.where = where


def _is_hf(obj: Any) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(obj, (datasets.Dataset, datasets.IterableDataset))


def encode_row(row: Mapping[str, Any], sample_id: int, tokenizer: Any) -> dict[str, Any]:
    """One row of a stream as an encoded sample with ``sample_id``: an encoded row (``input_ids`` present)
    is taken as is (``length`` defaults to ``len(input_ids)``); a chat row is converted
    (:func:`varpack.data.formats.row_to_messages`) and encoded (:func:`varpack.data.chat.encode_chat`).

    Raises:
        ValueError / TypeError: a bad row (sample id, field and, for files, ``FILE:LINE`` named); a chat row
            with no tokenizer.
    """
    where = getattr(row, "where", None)
    try:
        if "input_ids" in row:
            sample = dict(row)
            n = len(sample["input_ids"])
            if "labels" not in sample:
                raise ValueError(f"sample {sample_id}: an encoded row needs 'labels' beside 'input_ids'")
            if len(sample["labels"]) != n:
                raise ValueError(
                    f"sample {sample_id}: 'labels' has {len(sample['labels'])} entries, 'input_ids' {n}"
                )
            length = int(sample.setdefault("length", n))
            if length != n:
                raise ValueError(f"sample {sample_id}: 'length' is {length} but 'input_ids' has {n} tokens")
        else:
            if tokenizer is None:
                raise ValueError(f"sample {sample_id}: a chat row needs a tokenizer (none was given)")
            from varpack.data.chat import encode_chat
            from varpack.data.formats import row_to_messages

            messages, _ = row_to_messages(row, sample_id)
            sample = encode_chat(messages, tokenizer, sample_id=sample_id)
    except (ValueError, TypeError) as exc:
        if where:
            raise type(exc)(f"{where}: {exc}") from exc
        raise
    sample["sample_id"] = int(sample_id)
    return sample


class StreamingPackedDataset(IterableDataset):
    """Packs of a stream, planned online: an ``IterableDataset`` whose items are packs (lists of sample
    dicts with ``sample_id``), or batches of ``collator`` (module docstring: sharding, resuming).

    Args:
        source: a :class:`ChatStream` or anything it accepts (JSONL paths, a ``datasets`` dataset, a list
            of rows, a generator function); rows are chats or encoded samples.
        tokenizer: a Hugging Face tokenizer with a chat template (needed for chat rows).
        packing_length: tokens per pack.
        buffer_size: items packed together (:class:`varpack.plan.streaming.StreamingPacker`).
        strategy: planner strategy within the buffer (``"bfd"``).
        overflow: ``"error"``, ``"drop"``, ``"truncate"`` or ``"split"``, as :func:`varpack.plan.plan_packs`;
            a sample or piece without a supervised token is left out and reported by id, as in a plan.
        rank, world_size: this process's shard of the ranks; default: ``torch.distributed``'s when it is
            initialized, else ``0, 1``. Give ``world_size=1`` when something else shards the packs across
            ranks (accelerate's ``IterableDatasetShard`` under the HF Trainer).
        collator: a callable applied to every pack (``PaddingFreeCollator``): yields batches instead of packs.
        report_every: call ``report_fn`` with the packer's summary every this many packs (0: only at the end
            of the stream, where it is always called).
        report_fn: receives :meth:`StreamingPacker.summary` (``plan_summary`` format, with ``data`` and
            ``shard``); render with :func:`varpack.plan.report.summary_text`.
        token_fields: extra token-aligned fields cut for pieces of overlong samples.
        text_plane: plane of multi-plane ``position_ids`` that counts tokens.
        repeat: False (default): one iterator is one pass over the stream. True: one endless iterator, pass
            after pass (``epoch`` counts them), for a consumer that must not see a pass end: the HF Trainer
            ends its epoch there, and with gradient accumulation an optimizer step cut short by the end of an
            ``IterableDataset`` is not taken, its gradient adds to the next step's (each part divided by its
            own ``num_items_in_batch``), so ``varpack sft --streaming`` repeats inside the dataset.

    Raises:
        ValueError / TypeError: bad settings (by :class:`StreamingPacker`), a bad source; while iterating, a
            bad row (named) or an overlong sample with ``overflow="error"``; with ``repeat``, a pass of this
            shard that plans no pack (no rows, or every sample empty, dropped or without a supervised token),
            instead of looping forever.
    """

    def __init__(
        self,
        source: Any,
        tokenizer: Any = None,
        *,
        packing_length: int,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        strategy: str = "bfd",
        overflow: str = "error",
        rank: int | None = None,
        world_size: int | None = None,
        collator: Callable[[list[Any]], Any] | None = None,
        report_every: int = 0,
        report_fn: Callable[[dict[str, Any]], Any] | None = None,
        token_fields: Iterable[str] = (),
        text_plane: int = 0,
        repeat: bool = False,
    ) -> None:
        self.repeat = bool(repeat)
        self.stream = source if isinstance(source, ChatStream) else ChatStream(source)
        self.tokenizer = tokenizer
        self.packer_settings = dict(
            packing_length=packing_length, buffer_size=buffer_size, strategy=strategy, overflow=overflow
        )
        StreamingPacker(**self.packer_settings)  # refuse bad settings now, not in a worker
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither")
        if world_size is not None and not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank must be in 0..world_size-1, got rank={rank}, world_size={world_size}")
        self.rank, self.world_size = rank, world_size
        self.collator = collator
        self.report_every = int(report_every)
        self.report_fn = report_fn
        self.token_fields = TOKEN_ALIGNED_FIELDS + tuple(
            f for f in token_fields if f not in TOKEN_ALIGNED_FIELDS
        )
        self.text_plane = int(text_plane)
        self.epoch = 0
        self._resume: dict[str, Any] | None = None
        self._live: dict[str, Any] | None = None  # the iterating pass's state (this process's copy)
        # passes started in DataLoader workers, counted in memory shared with them (a worker's copy of this
        # dataset holds its own state; the main process's copy must not pass for it)
        self._worker_passes = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._worker_passes_seen = 0
        self.last_summary: dict[str, Any] | None = None

    # ------------------------------------------------------------------ sharding, epochs, state
    def shard(self) -> tuple[int, int]:
        """``(shard index, number of shards)`` of the calling process / DataLoader worker."""
        if self.world_size is not None:
            rank, world = int(self.rank), int(self.world_size)
        else:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
            else:
                rank, world = 0, 1
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        return rank * workers + wid, world * workers

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch (a new pass reads the stream from its start; the packs do not depend on it)."""
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the current pass is, after the last pack yielded (JSON-ready): ``{"format", "epoch",
        "shard": [index, count], "position", "packer", "pending"}``; before any pass, the loaded state or a
        fresh one. Called in a DataLoader worker (torchdata's ``StatefulDataLoader`` does), that worker's
        state.

        Raises:
            RuntimeError: called in the main process after DataLoader workers started reading the stream
                (since this process last iterated it or loaded a state): each worker holds its own position,
                and this process's copy would say the stream was not read.
        """
        started = int(self._worker_passes.item()) - self._worker_passes_seen
        if get_worker_info() is None and started:
            raise RuntimeError(
                "StreamingPackedDataset.state_dict() in the main process, but DataLoader workers read the "
                f"stream ({started} pass(es) started in workers): each worker holds its own position, so "
                "this copy's state is stale and resuming from it would train samples again. Take the state "
                "with num_workers=0, or from the workers with torchdata's StatefulDataLoader (it calls "
                "state_dict() in each worker)"
            )
        if self._live is not None:
            live = self._live
            pend: PackBatch = live["pending"]
            p0 = live["pending_pos"]
            a = int(pend.offsets[p0]) if pend.num_packs else 0
            return {
                "format": _FORMAT,
                "epoch": self.epoch,
                "shard": list(live["shard"]),
                "position": live["position"],
                "done": live["done"],
                "packer": live["packer"].state_dict(),
                "pending": {
                    "offsets": (pend.offsets[p0:] - a).tolist() if pend.num_packs else [0],
                    "sample_ids": pend.sample_ids[a:].tolist(),
                    "starts": pend.starts[a:].tolist(),
                    "stops": pend.stops[a:].tolist(),
                },
            }
        if self._resume is not None:
            return self._resume
        return {"format": _FORMAT, "epoch": self.epoch, "shard": None, "position": 0, "packer": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` at the next ``iter()`` (in the same shard).

        Raises:
            ValueError: not a stream state; at ``iter()``: another shard or other packer settings.
        """
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"not a StreamingPackedDataset state (expected format {_FORMAT!r})")
        self.epoch = int(state.get("epoch", 0))
        self._resume = state if state.get("packer") is not None else None
        self._live = None
        if get_worker_info() is None:
            self._worker_passes_seen = int(self._worker_passes.item())

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        if not self.repeat:
            yield from self._pass()
            return
        while True:
            packer = yield from self._pass()
            if packer.num_packs == 0:
                shard, num_shards = self.shard()
                where = f" (shard {shard} of {num_shards})" if num_shards > 1 else ""
                raise ValueError(
                    f"the stream {self.stream.label}{where} planned no pack in a pass: it has no rows, or every "
                    f"sample is empty, dropped or without a supervised token (overflow="
                    f"{self.packer_settings['overflow']!r}, packing_length="
                    f"{self.packer_settings['packing_length']}); nothing to train on"
                )
            self.epoch += 1

    def _pass(self) -> Generator[Any, None, StreamingPacker]:
        """One pass over this shard of the stream (from the loaded state, if any); returns its packer."""
        shard, num_shards = self.shard()
        if get_worker_info() is not None:
            self._worker_passes += 1  # seen by the main process (shared memory)
        else:
            self._worker_passes_seen = int(self._worker_passes.item())
        packer = StreamingPacker(**self.packer_settings)
        samples: dict[int, dict[str, Any]] = {}  # encoded samples with a piece in the buffer / pending
        refs: dict[int, int] = {}
        live: dict[str, Any] = {
            "shard": (shard, num_shards),
            "position": 0,
            "packer": packer,
            "done": False,
            "pending": PackBatch.empty(),
            "pending_pos": 0,
            "yielded": 0,
        }
        resume, self._resume = self._resume, None
        if resume is not None:
            if list(resume["shard"]) != [shard, num_shards]:
                raise ValueError(
                    f"the state was saved by shard {resume['shard'][0]} of {resume['shard'][1]}; this is shard "
                    f"{shard} of {num_shards} (same ranks and DataLoader workers are needed to resume)"
                )
            packer.load_state_dict(resume["packer"])
            p = resume["pending"]
            live["pending"] = PackBatch(
                *(np.asarray(p[k], np.int64) for k in ("offsets", "sample_ids", "starts", "stops"))
            )
            live["position"] = int(resume["position"])
            live["done"] = bool(resume.get("done", False))
            needed = set(packer.buffered_sample_ids.tolist()) | set(live["pending"].sample_ids.tolist())
            for sid in packer.buffered_sample_ids.tolist() + live["pending"].sample_ids.tolist():
                refs[sid] = refs.get(sid, 0) + 1
            # the buffered / pending samples are read and encoded again (the state holds ids, not tokens)
            for sid, row in self.stream.rows(
                shard=shard, num_shards=num_shards, wanted=needed.__contains__, stop=live["position"]
            ):
                samples[sid] = encode_row(row, sid, self.tokenizer)
            missing = needed - set(samples)
            if missing:
                raise ValueError(
                    f"resume: samples {sorted(missing)[:10]} of the saved buffer are not in the stream any more"
                )
        self._live = live
        yield from self._drain(live, samples, refs)
        if not live["done"]:
            L = packer.packing_length
            rep = packer.report
            for sid, row in self.stream.rows(shard=shard, num_shards=num_shards, start=live["position"]):
                sample = encode_row(row, sid, self.tokenizer)
                n = int(sample["length"])
                left_out = len(rep["unsupervised_ids"]) + len(rep["unsupervised_pieces"])
                # a sample or piece without a supervised token is left out and reported by the packer
                try:
                    batch = packer.add(n, [sid], supervised=supervised_ranges({sid: sample}))
                except ValueError as exc:  # an overlong sample under overflow="error": name its FILE:LINE
                    where = getattr(row, "where", None)
                    if where:
                        raise ValueError(f"{where}: {exc}") from exc
                    raise
                live["position"] = sid + 1
                pieces = (
                    0
                    if n == 0
                    else 1
                    if n <= L
                    else (-(-n // L) if packer.overflow == "split" else 0 if packer.overflow == "drop" else 1)
                )
                pieces -= len(rep["unsupervised_ids"]) + len(rep["unsupervised_pieces"]) - left_out
                where = getattr(row, "where", None)
                named = live.setdefault("locations", {})
                if where and len(named) < MAX_REPORTED_LOCATIONS and (
                    n > L or len(rep["unsupervised_ids"]) + len(rep["unsupervised_pieces"]) > left_out
                ):  # the report names overlong and left-out samples with their FILE:LINE
                    named[str(sid)] = where
                if pieces:
                    samples[sid] = sample
                    refs[sid] = pieces
                if batch.num_packs:
                    live["pending"], live["pending_pos"] = batch, 0
                    yield from self._drain(live, samples, refs)
            live["done"] = True
            live["pending"], live["pending_pos"] = packer.finish(), 0
            yield from self._drain(live, samples, refs)
        self.last_summary = self._summary(live)
        if self.report_fn is not None:
            self.report_fn(self.last_summary)
        return packer

    def _drain(
        self, live: dict[str, Any], samples: dict[int, dict[str, Any]], refs: dict[int, int]
    ) -> Iterator[Any]:
        """Yield the pending packs, the state advanced before each yield."""
        pend: PackBatch = live["pending"]
        while live["pending_pos"] < pend.num_packs:
            ids, starts, stops = pend.pack(live["pending_pos"])
            live["pending_pos"] += 1
            pack = []
            for sid, a, b in zip(ids.tolist(), starts.tolist(), stops.tolist()):
                src = samples[sid]
                refs[sid] -= 1
                if refs[sid] == 0:
                    del refs[sid], samples[sid]
                row = dict(src)
                if a != 0 or b != int(src["length"]):
                    cut_piece(
                        row, a, b, sample_id=sid, token_fields=self.token_fields, text_plane=self.text_plane
                    )
                pack.append(row)
            live["yielded"] += 1
            if self.report_fn is not None and self.report_every and live["yielded"] % self.report_every == 0:
                self.report_fn(self._summary(live))
            yield self.collator(pack) if self.collator is not None else pack
        live["pending"], live["pending_pos"] = PackBatch.empty(), 0

    def _summary(self, live: dict[str, Any]) -> dict[str, Any]:
        shard, num_shards = live["shard"]
        label = self.stream.label + (f" (shard {shard} of {num_shards})" if num_shards > 1 else "")
        context: dict[str, Any] = {"data": label, "shard": [shard, num_shards]}
        if live.get("locations"):
            context["locations"] = dict(live["locations"])
        return live["packer"].summary(**context)

    def __repr__(self) -> str:
        s = self.packer_settings
        return (
            f"StreamingPackedDataset(source={self.stream.label!r}, packing_length={s['packing_length']}, "
            f"buffer_size={s['buffer_size']}, strategy={s['strategy']!r}, overflow={s['overflow']!r})"
        )
