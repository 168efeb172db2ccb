"""`kvbridge check`: verify that a kv-events topic keeps the data contract, stream by stream.

The core (:class:`TopicChecker`, :class:`SentComparer`) is pure: feed it records in topic
order, ask for a report. Per stream (pod, dp_rank), in partition order:

* every epoch is opened by a marker before any other record of it: StreamStarted (first
  epoch the bridge saw, or a bridge restarted without checkpoints, or after PodRemoved) or
  PublisherRestarted (later epochs: its epoch must be greater than the current one, and its
  ``old_epoch`` the current one);
* per epoch, every batch seq from the opening ``next_seq`` (0 after PublisherRestarted) up
  to the highest seq seen (including a later PublisherRestarted's ``last_seq``) is accounted
  exactly once: by its events (indices 0..n-1, contiguous) or by one EventsLost range.
  A BlockStored split over several records (envelope ``part`` 0..parts-1, in order, nothing
  between them) is one event;
  A seq neither delivered nor lost is a *hole*; delivered and lost, or lost twice, is a
  *violation*; event seqs go non-decreasing (EventsLost ranges may come in any order);
* a record whose (epoch, seq, index) was already seen, or a marker identical to an earlier
  one (same epoch, seq and fields; its ``ts`` is ignored), is a *duplicate*: fine in
  at-least-once mode (``allow_duplicates``), a failure otherwise;
* PodRemoved ends all streams of its pod: what follows needs a new StreamStarted.

Batches that vanished from the end of an epoch are invisible here (nothing names them);
:func:`compare_with_sent` catches those against a simulator's sent-log.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bridge.cli.args import add_kafka_args, kafka_target, record_codec
from bridge.log.markers import (
    KAFKA_REFUSED,
    MARKER_TYPES,
    TAIL_END,
    EmptyBatch,
    EventsLost,
    Marker,
    PodRemoved,
    PublisherRestarted,
    StreamStarted,
)
from bridge.log.records import Record
from bridge.log.split import PartJoiner
from bridge.ops.config import ConfigError
from bridge.vllm.decoder import DecodeError, decode_batch
from bridge.vllm.events import BlockStored
from bridge.vllm.jsonview import event_to_json

__all__ = [
    "CheckReport",
    "SentComparer",
    "SentLogError",
    "StreamReport",
    "TopicChecker",
    "check_topic",
    "compare_with_sent",
    "configure_parser",
    "load_sent_log",
    "run",
]

StreamKey = tuple[str, int]
MAX_MESSAGES = 1000  # violation messages kept per stream (the rest are only counted)
MAX_SAMPLES = 5  # duplicate examples kept per stream


def _seqs(lo: int, hi: int) -> str:
    return f"seq {lo}" if lo == hi else f"seqs {lo}..{hi}"


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def _ranges(seqs: Iterable[int]) -> Iterator[tuple[int, int]]:
    """Sorted distinct ints -> maximal runs (lo, hi)."""
    lo = hi = None
    for s in seqs:
        if hi is not None and s == hi + 1:
            hi = s
            continue
        if lo is not None:
            yield lo, hi  # type: ignore[misc]
        lo = hi = s
    if lo is not None:
        yield lo, hi  # type: ignore[misc]


# --------------------------------------------------------------------------- reports


@dataclass
class StreamReport:
    pod: str
    dp_rank: int
    epochs: int = 0
    events: int = 0
    batches: int = 0
    lost_batches: int = 0
    unknown_tails: int = 0  # epochs closed by an open-ended EventsLost (a restart followed)
    lost_ranges: list[tuple[int, int, int, str]] = field(default_factory=list)  # epoch, from, to
    holes: list[tuple[int, int, int]] = field(default_factory=list)  # epoch, from, to
    duplicates: int = 0
    violations: list[str] = field(default_factory=list)
    markers: Counter[str] = field(default_factory=Counter)
    violations_not_shown: int = 0  # beyond MAX_MESSAGES
    duplicate_samples: list[str] = field(default_factory=list)

    @property
    def violation_count(self) -> int:
        return len(self.violations) + self.violations_not_shown

    @property
    def name(self) -> str:
        return f"{self.pod} rank {self.dp_rank}"


@dataclass
class CheckReport:
    streams: dict[StreamKey, StreamReport]
    records: int
    undecodable: int = 0
    allow_duplicates: bool = False
    sent_differences: list[str] | None = None  # None: no sent-log compared
    sent_notes: list[str] = field(default_factory=list)  # what the comparison left out
    # "partition:offset: reason" of the first few undecodable records
    undecodable_samples: list[str] = field(default_factory=list)

    @property
    def events(self) -> int:
        return sum(s.events for s in self.streams.values())

    @property
    def batches(self) -> int:
        return sum(s.batches for s in self.streams.values())

    @property
    def lost_batches(self) -> int:
        return sum(s.lost_batches for s in self.streams.values())

    @property
    def duplicates(self) -> int:
        return sum(s.duplicates for s in self.streams.values())

    @property
    def holes(self) -> list[tuple[str, int, int, int, int]]:
        """(pod, dp_rank, epoch, from, to) of every hole."""
        return [(p, r, *h) for (p, r), s in sorted(self.streams.items()) for h in s.holes]

    @property
    def hole_batches(self) -> int:
        return sum(to - lo + 1 for *_, lo, to in self.holes)

    @property
    def violation_count(self) -> int:
        return sum(s.violation_count for s in self.streams.values())

    @property
    def violations(self) -> list[str]:
        """Every kept violation message, prefixed with its stream."""
        return [f"{s.name}: {v}" for _, s in sorted(self.streams.items()) for v in s.violations]

    @property
    def markers(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for s in self.streams.values():
            total.update(s.markers)
        return total

    @property
    def ok(self) -> bool:
        """No holes, no violations, no undecodable records, no sent-log differences, and no
        duplicates unless they are allowed."""
        return not (
            self.holes
            or self.violation_count
            or self.undecodable
            or self.sent_differences
            or (self.duplicates and not self.allow_duplicates)
        )

    @property
    def totals(self) -> dict[str, int]:
        return {
            "streams": len(self.streams),
            "records": self.records,
            "events": self.events,
            "batches": self.batches,
            "lost_batches": self.lost_batches,
            "duplicates": self.duplicates,
            "holes": len(self.holes),
            "hole_batches": self.hole_batches,
            "violations": self.violation_count,
            "undecodable": self.undecodable,
            "sent_differences": len(self.sent_differences or ()),
        }

    def _summary(self) -> str:
        markers = ", ".join(f"{k}={v}" for k, v in sorted(self.markers.items())) or "none"
        dups = _plural(self.duplicates, "duplicate")
        if self.duplicates and self.allow_duplicates:
            dups += " (allowed)"
        return (
            f"{_plural(len(self.streams), 'stream')}, {self.events} events in "
            f"{self.batches} batches, {self.lost_batches} lost, {dups}, markers {markers}"
        )

    def verdict(self) -> str:
        """One line: ``OK: ...`` or ``FAIL: <problems> (<summary>)``."""
        if self.ok:
            return f"OK: {self._summary()}"
        problems = []
        if self.holes:
            batches = _plural(self.hole_batches, "batch", "batches")
            problems.append(f"{_plural(len(self.holes), 'hole')} ({batches})")
        if self.violation_count:
            problems.append(_plural(self.violation_count, "violation"))
        if self.duplicates and not self.allow_duplicates:
            problems.append(_plural(self.duplicates, "duplicate"))
        if self.undecodable:
            problems.append(_plural(self.undecodable, "undecodable record"))
        if self.sent_differences:
            problems.append(
                f"{_plural(len(self.sent_differences), 'difference')} from the sent-log"
            )
        return f"FAIL: {', '.join(problems)} ({self._summary()})"

    def undecodable_details(self) -> list[str]:
        """The undecodable records: how many, then the first few (partition:offset: why)."""
        if not self.undecodable:
            return []
        out = [f"{_plural(self.undecodable, 'record')} could not be decoded (skipped)"]
        out.extend(f"undecodable at {s}" for s in self.undecodable_samples)
        if self.undecodable > len(self.undecodable_samples):
            out.append(f"... and {self.undecodable - len(self.undecodable_samples)} more")
        return out

    def details(self) -> list[str]:
        """One line per problem (stream, epoch, seq range), then the lost ranges (for info)."""
        out: list[str] = []
        lost: list[str] = []
        for _, s in sorted(self.streams.items()):
            for epoch, lo, hi in s.holes:
                out.append(
                    f"{s.name} epoch {epoch}: hole: {_seqs(lo, hi)} neither delivered nor "
                    "reported lost"
                )
            out.extend(f"{s.name}: violation: {v}" for v in s.violations)
            if s.violations_not_shown:
                out.append(f"{s.name}: ... and {s.violations_not_shown} more violations")
            if s.duplicates:
                allowed = " (allowed)" if self.allow_duplicates else ""
                eg = "; ".join(s.duplicate_samples)
                out.append(f"{s.name}: {_plural(s.duplicates, 'duplicate record')}{allowed}: {eg}")
            for epoch, lo, hi, reason in s.lost_ranges:
                if hi == TAIL_END:
                    lost.append(f"{s.name} epoch {epoch}: ends after seq {lo - 1} ({reason})")
                else:
                    lost.append(f"{s.name} epoch {epoch}: lost {_seqs(lo, hi)}: {reason}")
        out.extend(self.undecodable_details())
        out.extend(f"sent-log: {d}" for d in self.sent_differences or ())
        out.extend(f"sent-log (note): {n}" for n in self.sent_notes)
        return out + lost


# --------------------------------------------------------------------------- checker core


class _Batches:
    """Events seen per batch seq of one epoch, as runs of consecutive seqs (4 bytes a batch)."""

    __slots__ = ("bases", "runs")

    def __init__(self) -> None:
        self.bases: list[int] = []
        self.runs: list[array[int]] = []

    def get(self, seq: int) -> int:
        bases, runs = self.bases, self.runs
        if not bases:
            return 0
        off = seq - bases[-1]
        if 0 <= off < len(runs[-1]):
            return runs[-1][off]
        i = bisect_right(bases, seq) - 1
        if i >= 0 and seq - bases[i] < len(runs[i]):
            return runs[i][seq - bases[i]]
        return 0

    def set(self, seq: int, n: int) -> None:
        bases, runs = self.bases, self.runs
        if bases:
            last = runs[-1]
            off = seq - bases[-1]
            if off == len(last) - 1:
                last[off] = n
                return
            if off == len(last):
                last.append(n)
                return
        i = bisect_right(bases, seq) - 1
        if i >= 0:
            off = seq - bases[i]
            if off < len(runs[i]):
                runs[i][off] = n
                return
            if off == len(runs[i]):  # the next run (if any) starts above seq
                runs[i].append(n)
                return
        bases.insert(i + 1, seq)
        runs.insert(i + 1, array("I", [n]))

    def __len__(self) -> int:
        return sum(len(r) for r in self.runs)

    def intervals(self) -> Iterator[tuple[int, int]]:
        for base, run in zip(self.bases, self.runs, strict=True):
            yield base, base + len(run) - 1

    def overlapping(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Delivered seqs within lo..hi, as ranges."""
        out = []
        i = bisect_right(self.bases, hi) - 1
        while i >= 0:
            base = self.bases[i]
            end = base + len(self.runs[i]) - 1
            if end < lo:
                break
            out.append((max(lo, base), min(hi, end)))
            i -= 1
        return out[::-1]


_EMPTY = "\x00empty batch"  # the "reason" of an EmptyBatch among an epoch's accounted ranges


class _Epoch:
    __slots__ = ("epoch", "start", "opened", "batches", "cur_seq", "max_seq", "must_reach")

    def __init__(self, epoch: int, start: int, opened: bool) -> None:
        self.epoch = epoch
        self.start = start  # seqs below are not part of the epoch's account
        self.opened = opened  # by a marker (False: its first record came without one)
        self.batches = _Batches()
        self.cur_seq = -1  # seq of the last event record
        self.max_seq = -1  # highest event seq
        self.must_reach = -1  # a later PublisherRestarted's last_seq

    def account(self, lost: list[tuple[int, int, str]]) -> tuple[list, list[str]]:
        """(holes as (from, to), violations) of this epoch, given its EventsLost ranges."""
        problems: list[str] = []
        e = self.epoch
        spans = list(self.batches.intervals())
        prev_end = -1
        for lo, hi, reason in sorted(lost):
            if lo <= prev_end:
                problems.append(f"epoch {e}: {_seqs(lo, min(hi, prev_end))} reported lost twice")
            prev_end = max(prev_end, hi)
            both = self.batches.overlapping(lo, hi)
            if both and not reason.startswith(KAFKA_REFUSED):  # a partly written batch is fine
                which = ", ".join(_seqs(a, b) for a, b in both)
                problems.append(f"epoch {e}: {which} delivered and also reported lost")
            spans.append((lo, hi))
        top = max([self.max_seq, self.must_reach, *(hi for _, hi, _ in lost)])
        holes = []
        pos = self.start
        for lo, hi in sorted(spans):
            if hi < pos:
                continue
            if lo > pos:
                holes.append((pos, lo - 1))
            pos = hi + 1
        if pos <= top:
            holes.append((pos, top))
        return holes, problems


class _Stream:
    def __init__(self, pod: str, rank: int) -> None:
        self.report = StreamReport(pod, rank)
        self.epochs: dict[int, _Epoch] = {}
        self.lost: dict[int, list[tuple[int, int, str]]] = {}
        self.current: int | None = None
        self.removed = False  # PodRemoved seen and no epoch opened since
        self.seen_markers: set[tuple[int, int, Marker]] = set()
        # A BlockStored split over records being read: (epoch, seq, index, next part, parts).
        self.split: tuple[int, int, int, int, int] | None = None
        # Epochs opened by StreamStarted, and the epoch a StreamStarted took over from: after
        # --repartition a moved pod's old-partition records of that older epoch can come
        # after the new epoch's; they are checked as their own chain (late_*), never applied
        # to the current epoch.
        self.started: set[int] = set()
        self.late_current: int | None = None
        self.late_removed = False
        self.swapped = False

    def is_late(self, e: int) -> bool:
        """A record of an older epoch after a StreamStarted took the stream over from it."""
        return (
            not self.swapped
            and self.late_current is not None
            and self.current is not None
            and e < self.current
            and self.current in self.started
        )

    def swap_chain(self) -> None:
        """Exchange the current chain of epochs with the late one (see ``started``)."""
        self.current, self.late_current = self.late_current, self.current
        self.removed, self.late_removed = self.late_removed, self.removed
        self.swapped = not self.swapped

    def violation(self, msg: str) -> None:
        r = self.report
        if len(r.violations) < MAX_MESSAGES:
            r.violations.append(msg)
        else:
            r.violations_not_shown += 1

    def duplicate(self, msg: str) -> None:
        r = self.report
        r.duplicates += 1
        if len(r.duplicate_samples) < MAX_SAMPLES:
            r.duplicate_samples.append(msg)

    def _state(self) -> str:
        if self.current is not None:
            return f"the stream is in epoch {self.current}"
        return "the pod was removed" if self.removed else "no epoch was opened"

    def close(self) -> None:
        self.current = None
        self.removed = True

    def _epoch_of(self, e: int, seq: int, what: str) -> _Epoch:
        """The epoch a non-opening record belongs to (reporting records out of place)."""
        ep = self.epochs.get(e)
        if ep is None:
            self.violation(
                f"epoch {e} seq {seq}: {what} before any StreamStarted/PublisherRestarted "
                f"opened epoch {e} ({self._state()})"
            )
            ep = self.epochs[e] = _Epoch(e, 0, opened=False)
            self.current = e
            self.removed = False
        elif e != self.current:
            self.violation(f"epoch {e} seq {seq}: {what} of epoch {e}, but {self._state()}")
        return ep

    def open(self, e: int, marker: StreamStarted | PublisherRestarted) -> None:
        name = type(marker).__name__
        if isinstance(marker, PublisherRestarted):
            start = 0
            old, cur = marker.old_epoch, self.current
            if cur is None:
                self.violation(
                    f"epoch {e}: PublisherRestarted (old epoch {old}) opens an epoch but "
                    f"{self._state()}; expected StreamStarted"
                )
            else:
                if old != cur:
                    self.violation(
                        f"epoch {e}: PublisherRestarted names old epoch {old}, but the "
                        f"stream was in epoch {cur}"
                    )
                if e <= cur:
                    self.violation(
                        f"epoch {e}: PublisherRestarted goes back from epoch {cur} "
                        "(epochs only grow)"
                    )
            prev = self.epochs.get(old)
            if prev is not None and old == cur:
                last = marker.last_seq
                if last is None:
                    if prev.max_seq >= 0:
                        self.violation(
                            f"epoch {old}: PublisherRestarted says no batch was delivered, "
                            f"but the epoch has events up to seq {prev.max_seq}"
                        )
                else:
                    prev.must_reach = max(prev.must_reach, last)
                    if prev.max_seq > last:
                        self.violation(
                            f"epoch {old}: events up to seq {prev.max_seq}, but "
                            f"PublisherRestarted says the last delivered seq was {last}"
                        )
        else:
            start = marker.next_seq
            if not self.swapped:
                if self.current is not None and e > self.current:
                    self.late_current, self.late_removed = self.current, False
                self.started.add(e)
        ep = self.epochs.get(e)
        if ep is None:
            self.epochs[e] = _Epoch(e, start, opened=True)
        elif not ep.opened:  # its records came first (already reported)
            ep.opened = True
            ep.start = min(ep.start, start)
        else:
            self.violation(f"epoch {e}: {name} opens it again (it was opened before)")
        self.current = e
        self.removed = False

    def empty_batch(self, e: int, seq: int) -> None:
        """Batch ``seq`` held no events: accounted like a one-seq range, counted as a batch."""
        ep = self._epoch_of(e, seq, "EmptyBatch")
        if seq < ep.max_seq:
            self.violation(f"epoch {e}: EmptyBatch at seq {seq} arrives after seq {ep.max_seq}")
        ep.max_seq = max(ep.max_seq, seq)
        self.lost.setdefault(e, []).append((seq, seq, _EMPTY))

    def lost_range(self, e: int, seq: int, m: EventsLost) -> None:
        self._epoch_of(e, seq, "EventsLost")
        if m.from_seq > m.to_seq:
            self.violation(f"epoch {e}: EventsLost {m.from_seq}..{m.to_seq} is an empty range")
            return
        self.lost.setdefault(e, []).append((m.from_seq, m.to_seq, m.reason))

    def unfinished(self) -> str | None:
        """The violation of a split event whose parts stopped short, if one is being read."""
        if self.split is None:
            return None
        e, seq, index, got, parts = self.split
        return (
            f"epoch {e} seq {seq} index {index}: a BlockStored split into {parts} records, "
            f"but only parts 0..{got - 1} are there"
        )

    def end_split(self) -> None:
        msg = self.unfinished()
        if msg is not None:
            self.violation(msg)
            self.split = None

    def part(self, e: int, seq: int, index: int, part: int, parts: int, stored: bool) -> None:
        """A record of a BlockStored split over ``parts`` records: one event, its parts in
        order (0..parts-1) and nothing between them."""
        where = f"epoch {e} seq {seq} index {index}"
        if not stored or not 0 <= part < parts:
            what = "" if stored else " on a record that is not a BlockStored"
            self.violation(f"{where}: part {part} of {parts}{what}")
            return
        pending = self.split
        if part == 0:
            self.end_split()
            if self.event(e, seq, index):
                self.split = (e, seq, index, 1, parts)
            return
        if pending is not None and pending[:3] == (e, seq, index):
            if pending[3:] == (part, parts):
                self.split = None if part + 1 == parts else (e, seq, index, part + 1, parts)
                return
        else:
            ep = self.epochs.get(e)
            if ep is not None and ep.batches.get(seq) > index:  # the event was read before
                self.duplicate(f"{where} part {part}")
                return
        self.end_split()
        self.violation(f"{where}: part {part} of {parts} without the parts before it")

    def event(self, e: int, seq: int, index: int) -> bool:
        """One event record (a split event's first part); False if it is a duplicate."""
        ep = self.epochs.get(e)
        have = 0 if ep is None else ep.batches.get(seq)
        if index < have:
            self.duplicate(f"epoch {e} seq {seq} index {index}")
            return False
        if ep is None or e != self.current:
            ep = self._epoch_of(e, seq, "event")
        self.report.events += 1
        if seq == ep.cur_seq:
            if index > have:
                self.violation(
                    f"epoch {e} seq {seq}: index {index} follows index {have - 1} "
                    f"(indices {have}..{index - 1} missing)"
                )
        elif have:
            self.violation(
                f"epoch {e} seq {seq}: index {index} arrives after other batches "
                f"(seq {seq} had ended at index {have - 1})"
            )
        else:
            if seq < ep.max_seq:
                self.violation(f"epoch {e}: seq {seq} arrives after seq {ep.max_seq}")
            if seq < ep.start:
                self.violation(
                    f"epoch {e}: seq {seq} is below the epoch's first seq {ep.start} "
                    "(StreamStarted next_seq)"
                )
            if index != 0:
                self.violation(
                    f"epoch {e} seq {seq}: first event has index {index} "
                    f"(indices 0..{index - 1} missing)"
                )
        ep.cur_seq = seq
        ep.batches.set(seq, index + 1)
        if seq > ep.max_seq:
            ep.max_seq = seq
        return True

    def build(self) -> StreamReport:
        """The report as of now (the stream's state is not changed)."""
        base = self.report
        r = StreamReport(
            base.pod,
            base.dp_rank,
            epochs=len(self.epochs),
            events=base.events,
            duplicates=base.duplicates,
            violations=list(base.violations),
            markers=Counter(base.markers),
            violations_not_shown=base.violations_not_shown,
            duplicate_samples=list(base.duplicate_samples),
        )
        unfinished = self.unfinished()
        if unfinished is not None:
            r.violations.append(unfinished)
        for e, ep in self.epochs.items():
            lost = self.lost.get(e, [])
            holes, problems = ep.account(lost)
            r.holes.extend((e, lo, hi) for lo, hi in holes)
            for msg in problems:
                if len(r.violations) < MAX_MESSAGES:
                    r.violations.append(msg)
                else:
                    r.violations_not_shown += 1
            r.batches += len(ep.batches)
            for lo, hi, reason in lost:
                if reason is _EMPTY:
                    r.batches += 1
                    continue
                r.lost_ranges.append((e, lo, hi, reason))
                if hi == TAIL_END:
                    r.unknown_tails += 1
                else:
                    r.lost_batches += hi - lo + 1
        return r


class TopicChecker:
    """Checks records fed one by one in topic order; :meth:`report` any time.

    With ``sent`` (a simulator's sent-log), the report also carries
    :attr:`CheckReport.sent_differences` (see :class:`SentComparer`).
    """

    def __init__(
        self, allow_duplicates: bool = False, sent: Iterable[dict[str, Any]] | None = None
    ) -> None:
        self.allow_duplicates = allow_duplicates
        self.records = 0
        self.undecodable = 0  # set by the reader's owner: records it could not decode
        self.undecodable_samples: list[str] = []  # and where the first few are, and why
        self._streams: dict[StreamKey, _Stream] = {}
        self._by_pod: dict[str, list[_Stream]] = {}
        self._sent = None if sent is None else SentComparer(sent)

    def _stream(self, pod: str, rank: int) -> _Stream:
        st = self._streams.get((pod, rank))
        if st is None:
            st = self._streams[(pod, rank)] = _Stream(pod, rank)
            self._by_pod.setdefault(pod, []).append(st)
        return st

    def add(self, record: Record) -> None:
        self.records += 1
        if self._sent is not None:
            self._sent.add(record)
        env = record.envelope
        st = self._stream(env.pod, env.dp_rank)
        if st.is_late(env.epoch):
            st.swap_chain()
            try:
                self._add(st, record, late=True)
            finally:
                st.swap_chain()
        else:
            self._add(st, record, late=False)

    def _add(self, st: _Stream, record: Record, late: bool) -> None:
        env, ev = record.envelope, record.event
        e, seq = env.epoch, env.seq
        if not isinstance(ev, MARKER_TYPES):
            if env.index < 0:
                st.violation(f"epoch {e} seq {seq}: {type(ev).__name__} with index {env.index}")
                return
            if env.parts != 1 or env.part:
                st.part(e, seq, env.index, env.part, env.parts, type(ev) is BlockStored)
                return
            if st.split is not None:
                st.end_split()
            st.event(e, seq, env.index)
            return
        if st.split is not None:
            st.end_split()
        name = type(ev).__name__
        if env.index != -1:
            st.violation(f"epoch {e} seq {seq}: marker {name} with index {env.index} (not -1)")
        key = (e, seq, ev)
        if key in st.seen_markers:
            st.duplicate(f"{name} epoch {e} seq {seq}")
            return
        st.seen_markers.add(key)
        st.report.markers[name] += 1
        if isinstance(ev, StreamStarted | PublisherRestarted):
            st.open(e, ev)
        elif isinstance(ev, EventsLost):
            st.lost_range(e, seq, ev)
        elif isinstance(ev, EmptyBatch):
            st.empty_batch(e, seq)
        elif isinstance(ev, PodRemoved):
            for other in [st] if late else self._by_pod[env.pod]:
                other.close()

    def report(self) -> CheckReport:
        return CheckReport(
            streams={k: s.build() for k, s in self._streams.items()},
            records=self.records,
            undecodable=self.undecodable,
            undecodable_samples=list(self.undecodable_samples),
            allow_duplicates=self.allow_duplicates,
            sent_differences=None if self._sent is None else self._sent.differences(),
            sent_notes=[] if self._sent is None else list(self._sent.notes),
        )


# --------------------------------------------------------------------------- sent-log


class SentLogError(ValueError):
    """A sent-log record that is not what `kvbridge simulate --sent-log` writes."""


@dataclass(slots=True)
class _SentBatch:
    sent: str
    events: list[dict[str, Any]]
    seen: int = 0  # events of it found in the topic (indices 0..seen-1; 1 for an EmptyBatch)


def _normal(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SentComparer:
    """What the topic holds vs. what a simulator published (its sent-log), incrementally.

    Mapping assumption: incarnation k of a simulated (pod, rank) is the k-th epoch of that
    stream in the topic (epochs in order of first appearance; StreamStarted and
    PublisherRestarted open them). This holds when one bridge run followed the stream from
    its first incarnation and saw every restart; a bridge restarted without checkpoints
    opens a new epoch inside the same incarnation and breaks it.

    Every published batch (``sent`` "live" or "dropped") must be in the topic with exactly
    its events (``event_to_json`` of each, in order) unless an EventsLost of its epoch covers
    it; a "lost" batch must be covered by an EventsLost. Topic batches and EventsLost seqs
    the sent-log lacks are differences too. Duplicate records are skipped here (the
    checker counts them).
    """

    def __init__(self, sent: Iterable[dict[str, Any]], max_messages: int = MAX_MESSAGES) -> None:
        self._sent: dict[StreamKey, dict[int, dict[int, _SentBatch]]] = {}
        for n, entry in enumerate(sent, 1):
            try:
                key = (str(entry["pod"]), int(entry.get("dp_rank", 0)))
                inc, seq = int(entry.get("incarnation", 0)), int(entry["seq"])
                how = entry.get("sent", "live")
                events = _published_events(entry)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise SentLogError(
                    f"sent-log entry {n}: not a published-batch record ({exc!r}); each line "
                    'needs "pod" and "seq", and "events" or "payload" (see docs/operations.md)'
                ) from exc
            if how not in ("live", "dropped", "lost"):
                raise SentLogError(f"sent-log entry {n}: sent={how!r}, expected live/dropped/lost")
            batches = self._sent.setdefault(key, {}).setdefault(inc, {})
            if seq in batches:
                raise SentLogError(
                    f"sent-log entry {n}: {key[0]} rank {key[1]} incarnation {inc} "
                    f"seq {seq} appears twice"
                )
            batches[seq] = _SentBatch(how, events)
        self._incarnations: dict[StreamKey, dict[int, int]] = {}  # epoch -> incarnation
        self._lost: dict[tuple[StreamKey, int], list[tuple[int, int]]] = {}  # by epoch
        self._unknown: dict[tuple[StreamKey, int], set[int]] = {}  # by incarnation
        self._diffs: list[str] = []
        self.notes: list[str] = []  # not differences: what the comparison left out, and why
        self._more = 0
        self._max = max_messages
        self._joiner = PartJoiner()  # a split BlockStored is compared as the event it was

    def _sent_end(self, key: StreamKey, inc: int) -> int:
        """The highest seq the sent-log can vouch for in ``inc``: its last seq there, or no
        limit for an earlier incarnation (a later one was logged, so this one had ended) or a
        stream it does not list; -1 for an incarnation it has not reached yet."""
        incs = self._sent.get(key, {})
        if not incs:
            return TAIL_END  # a stream the sent-log does not know at all: everything differs
        if inc > max(incs):
            return -1
        if inc < max(incs):
            return TAIL_END
        return max(incs[inc])

    def _note(self, msg: str) -> None:
        if len(self._diffs) < self._max:
            self._diffs.append(msg)
        else:
            self._more += 1

    def _label(self, key: StreamKey, inc: int, epoch: int | None) -> str:
        where = "no epoch in the topic" if epoch is None else f"epoch {epoch}"
        return f"{key[0]} rank {key[1]} incarnation {inc} ({where})"

    def add(self, record: Record) -> None:
        if record.envelope.parts != 1:
            joined = self._joiner.add(record)
            if joined is None:
                return
            record = joined
        env, ev = record.envelope, record.event
        if isinstance(ev, PodRemoved):
            return
        key = (env.pod, env.dp_rank)
        incs = self._incarnations.setdefault(key, {})
        inc = incs.get(env.epoch)
        if inc is None:
            inc = incs[env.epoch] = len(incs)
        if isinstance(ev, EventsLost):
            self._lost.setdefault((key, env.epoch), []).append((ev.from_seq, ev.to_seq))
            return
        if isinstance(ev, EmptyBatch):
            batch = self._sent.get(key, {}).get(inc, {}).get(env.seq)
            if batch is None:
                self._unknown.setdefault((key, inc), set()).add(env.seq)
            elif batch.events:
                where = f"{self._label(key, inc, env.epoch)} seq {env.seq}"
                self._note(
                    f"{where}: topic has EmptyBatch; the batch had {len(batch.events)} events"
                )
            else:
                batch.seen = 1
            return
        if isinstance(ev, MARKER_TYPES) or env.index < 0:
            return
        batch = self._sent.get(key, {}).get(inc, {}).get(env.seq)
        if batch is None:
            self._unknown.setdefault((key, inc), set()).add(env.seq)
            return
        idx = env.index
        if idx < batch.seen:
            return
        where = f"{self._label(key, inc, env.epoch)} seq {env.seq}"
        if idx > batch.seen:
            self._note(f"{where}: topic has index {idx} after {batch.seen} events of the batch")
        batch.seen = idx + 1
        if idx >= len(batch.events):
            self._note(f"{where}: topic has index {idx}; the batch had {len(batch.events)} events")
            return
        want, got = batch.events[idx], event_to_json(ev)  # type: ignore[arg-type]
        if got != want and _normal(got) != _normal(want):
            got, want = _normal(got), _normal(want)
            names = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
            diff = "; ".join(
                f"{k}: topic {_short(got.get(k))}, sent {_short(want.get(k))}" for k in names
            )
            self._note(f"{where} index {idx}: {got.get('type')} differs: {diff}")

    def differences(self) -> list[str]:
        """Every difference found (``[]`` when topic and sent-log agree)."""
        out = list(self._diffs)
        for key, incs in sorted(self._sent.items()):
            epochs = {inc: epoch for epoch, inc in self._incarnations.get(key, {}).items()}
            for inc, batches in sorted(incs.items()):
                epoch = epochs.get(inc)
                label = self._label(key, inc, epoch)
                covered = _Cover(self._lost.get((key, epoch), []) if epoch is not None else [])
                absent, uncovered, partial = [], [], []
                for seq in sorted(batches):
                    b = batches[seq]
                    is_lost = covered(seq)
                    if b.sent == "lost":
                        if not is_lost:
                            uncovered.append(seq)
                    elif not is_lost:
                        if b.seen == 0:
                            absent.append(seq)
                        elif b.seen < len(b.events):
                            partial.append((seq, b.seen, len(b.events)))
                out.extend(
                    f"{label}: {_seqs(lo, hi)} published but not in the topic "
                    "(no events, no EventsLost)"
                    for lo, hi in _ranges(absent)
                )
                out.extend(
                    f"{label}: {_seqs(lo, hi)} never sent by the publisher (lost), but no "
                    "EventsLost covers it"
                    for lo, hi in _ranges(uncovered)
                )
                out.extend(
                    f"{label} seq {seq}: topic has {got} of the batch's {n} events"
                    for seq, got, n in partial
                )
        self.notes = []
        for (key, inc), seqs in sorted(self._unknown.items()):
            epoch = next((e for e, i in self._incarnations[key].items() if i == inc), None)
            label = self._label(key, inc, epoch)
            end = self._sent_end(key, inc)
            tail = sorted(s for s in seqs if s > end)
            if tail:  # the publisher went on after the sent-log was read: not compared
                self.notes.append(
                    f"{label}: topic has {_plural(len(tail), 'batch', 'batches')} past the "
                    f"sent-log's end ({_seqs(tail[0], tail[-1])}): the publisher was still "
                    "running when the sent-log was read; compared up to its end"
                )
            out.extend(
                f"{label}: topic has events at {_seqs(lo, hi)}, which the sent-log does not list"
                for lo, hi in _ranges(sorted(s for s in seqs if s <= end))
            )
        for (key, epoch), ranges in sorted(self._lost.items()):
            inc = self._incarnations[key][epoch]
            known = sorted(self._sent.get(key, {}).get(inc, {}))
            for lo, hi in ranges:
                if hi == TAIL_END:  # "whatever came after, if anything": up to what was sent
                    hi = max(known[-1] if known else lo, lo)
                    if not known or lo > known[-1]:
                        continue
                end = self._sent_end(key, inc)
                if lo > end:
                    continue  # past the sent-log's end (see notes)
                for a, b in _missing(known, lo, min(hi, end)):
                    out.append(
                        f"{self._label(key, inc, epoch)}: EventsLost covers {_seqs(a, b)}, "
                        "which the sent-log does not list"
                    )
        if self._more:
            out.append(f"... and {self._more} more differences")
        return out


class _Cover:
    """Membership of a seq in a set of inclusive ranges."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.los = [m[0] for m in merged]
        self.his = [m[1] for m in merged]

    def __call__(self, seq: int) -> bool:
        i = bisect_right(self.los, seq) - 1
        return i >= 0 and seq <= self.his[i]


def _missing(known: list[int], lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """Ranges of lo..hi not in the sorted list ``known``."""
    pos = lo
    i = bisect_right(known, lo - 1)
    while i < len(known) and known[i] <= hi:
        if known[i] > pos:
            yield pos, known[i] - 1
        pos = known[i] + 1
        i += 1
    if pos <= hi:
        yield pos, hi


def compare_with_sent(records: Iterable[Any], sent: Iterable[dict[str, Any]]) -> list[str]:
    """Differences between the topic's records (Record or ConsumedRecord, in topic order)
    and a simulator's sent-log records; ``[]`` when they agree. See :class:`SentComparer`."""
    if isinstance(records, CheckReport):
        raise TypeError(
            "compare_with_sent needs the records, not a CheckReport; use "
            "TopicChecker(sent=...) or check_topic(sent=...) to compare while checking"
        )
    cmp = SentComparer(sent)
    for r in records:
        cmp.add(r if isinstance(r, Record) else r.record)
    return cmp.differences()


def _published_events(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A sent-log line's events, as ``event_to_json`` shows them: its ``events`` list, or
    its ``payload`` (the batch's msgpack bytes as hex, as captured from the engine) decoded."""
    if "events" in entry:
        return list(entry["events"])
    if entry.get("sent") == "lost":
        return []
    try:
        batch = decode_batch(bytes.fromhex(entry["payload"]))
    except DecodeError as exc:
        raise ValueError(f"payload does not decode: {exc}") from exc
    return [event_to_json(e) for e in batch.events]


def load_sent_log(path: str) -> list[dict[str, Any]]:
    """A simulator sent-log (JSON lines; ``-`` for stdin).

    A final line without its newline that does not parse is one a running simulator is
    still writing (a long line takes several writes): it is left out, not an error.
    """
    try:
        f = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise ConfigError(f"--expect-sent {path}: {exc.strerror}") from exc
    out = []
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if not line.endswith("\n"):
                    break  # the last line, still being written by a running simulator
                raise ConfigError(
                    f"--expect-sent {path} line {n}: not JSON ({exc.msg}); expected the "
                    "JSON lines `kvbridge simulate --sent-log` writes"
                ) from exc
    return out


# --------------------------------------------------------------------------- I/O + CLI


def check_topic(
    bootstrap: str,
    topic: str,
    allow_duplicates: bool = False,
    overrides: dict[str, Any] | None = None,
    *,
    pods: Iterable[str] | None = None,
    sent: Iterable[dict[str, Any]] | None = None,
    progress: Callable[[int], None] | None = None,
    codec: Any = None,
) -> CheckReport:
    """Read the whole topic (from the beginning to the end seen at the start) and check it.

    ``pods``: only these pods; ``sent``: also compare with a sent-log; ``progress``: called
    with the number of records read, every 1000 records and at the end.
    """
    from bridge.consume.reader import TopicReader

    only = set(pods) if pods else None
    checker = TopicChecker(allow_duplicates, sent)
    n = 0
    with TopicReader(bootstrap, topic, overrides, codec=codec) as reader:
        for cr in reader.read():
            n += 1
            if progress is not None and n % 1000 == 0:
                progress(n)
            if only is None or cr.record.envelope.pod in only:
                checker.add(cr.record)
        checker.undecodable = reader.skipped
        checker.undecodable_samples = reader.undecodable.samples()
    if progress is not None:
        progress(n)
    return checker.report()


DESCRIPTION = """\
Read the whole topic and verify the data contract for every (pod, rank) stream: each epoch
opened by StreamStarted/PublisherRestarted, every batch seq accounted for exactly once (its
events, indices 0..n-1, or one EventsLost range), seqs in order, no duplicates. Prints one
line (OK/FAIL with totals) and exits 0 when the topic is sound, 1 otherwise. A record that
is not a kv-events record (a tombstone, another producer's bytes) is skipped, listed with
its partition:offset and why, and fails the check.

  kvbridge check --topic kv-events -v
  kvbridge check --allow-duplicates           # at-least-once: duplicates are not a failure
  kvbridge check --expect-sent sent.jsonl     # also compare with `simulate --sent-log`
"""


def configure_parser(p: argparse.ArgumentParser) -> None:
    if p.description is None:
        p.description = DESCRIPTION
        p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_kafka_args(p, "topic to check")
    p.add_argument(
        "--allow-duplicates",
        action="store_true",
        help="duplicate records (at-least-once delivery after a bridge crash) are not a failure",
    )
    p.add_argument(
        "--pod", action="append", default=[], metavar="NAME", help="only these pods (repeatable)"
    )
    p.add_argument(
        "--expect-sent",
        metavar="FILE",
        help="JSON lines of what was published (a `kvbridge simulate --sent-log` file, or your "
        "own capture: pod, dp_rank, seq, and events or payload hex; docs/operations.md): every "
        "batch published must be in the topic with exactly its events, or covered by "
        "EventsLost; batches past its end are left out ('-' = stdin)",
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print every problem and lost range"
    )


class _Progress:
    """Running count on a terminal, at most once a second."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.next_at = time.monotonic() + 1.0
        self.shown = False

    def __call__(self, n: int) -> None:
        now = time.monotonic()
        if now >= self.next_at:
            self.next_at = now + 1.0
            self.stream.write(f"\r{n} records read ...")
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def run(args: argparse.Namespace) -> int:
    """`kvbridge check`: 0 if the topic is sound, 1 if not."""
    bootstrap, topic, overrides = kafka_target(args)
    sent = None
    if args.expect_sent:
        sent = load_sent_log(args.expect_sent)
        if args.pod:
            wanted = set(args.pod)
            sent = [s for s in sent if s.get("pod") in wanted]
    progress = _Progress(sys.stderr) if sys.stderr.isatty() else None
    try:
        report = check_topic(
            bootstrap,
            topic,
            args.allow_duplicates,
            overrides,
            pods=args.pod or None,
            codec=record_codec(args),
            sent=sent,
            progress=progress,
        )
    except SentLogError as exc:
        raise ConfigError(f"--expect-sent {args.expect_sent}: {exc}") from exc
    finally:
        if progress is not None:
            progress.clear()
    print(report.verdict())
    # Records that are not kv-events records are always listed: an operator must know.
    for line in report.details() if args.verbose else report.undecodable_details():
        print(f"  {line}")
    if not args.verbose:  # the live tail left out of the comparison: say so
        for note in report.sent_notes:
            print(f"  note: {note}")
    return 0 if report.ok else 1
