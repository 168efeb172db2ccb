"""The topic checker: does a kv-events topic keep the data contract, stream by stream?

:class:`TopicChecker` is pure: feed it records in topic order, ask for a report
(:mod:`bridge.consume.checkreport`); :func:`check_topic` reads a topic through it (`kvbridge
check`, :mod:`bridge.cli.check`). The rules, per stream (pod, dp_rank), in partition order:

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
:mod:`bridge.consume.sentlog` catches those against a simulator's sent-log.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from bridge.consume.checkreport import (
    MAX_MESSAGES,
    MAX_SAMPLES,
    CheckReport,
    StreamKey,
    StreamReport,
    seq_span,
)
from bridge.consume.sentlog import SentComparer
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
from bridge.vllm.events import BlockStored


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
                problems.append(f"epoch {e}: {seq_span(lo, min(hi, prev_end))} reported lost twice")
            prev_end = max(prev_end, hi)
            both = self.batches.overlapping(lo, hi)
            if both and not reason.startswith(KAFKA_REFUSED):  # a partly written batch is fine
                which = ", ".join(seq_span(a, b) for a, b in both)
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


def check_topic(
    bootstrap: str,
    topic: str,
    allow_duplicates: bool = False,
    overrides: dict[str, Any] | None = None,
    *,
    pods: Iterable[str] | None = None,
    sent: Iterable[dict[str, Any]] | None = None,
    progress: Callable[[int, tuple[int, int | None]], None] | None = None,
    codec: Any = None,
) -> CheckReport:
    """Read the whole topic (from the beginning to the end seen at the start) and check it.

    ``pods``: only these pods; ``sent``: also compare with a sent-log; ``progress``: called
    every 1000 records and at the end with the number of records read and
    ``TopicReader.progress()`` (offsets read, offsets to read).
    """
    from bridge.consume.reader import TopicReader

    only = set(pods) if pods else None
    checker = TopicChecker(allow_duplicates, sent)
    n = 0
    with TopicReader(bootstrap, topic, overrides, codec=codec) as reader:
        for cr in reader.read():
            n += 1
            if progress is not None and n % 1000 == 0:
                progress(n, reader.progress())
            if only is None or cr.record.envelope.pod in only:
                checker.add(cr.record)
        checker.undecodable = reader.skipped
        checker.undecodable_samples = reader.undecodable.samples()
        if progress is not None:
            progress(n, reader.progress())
    return checker.report()
