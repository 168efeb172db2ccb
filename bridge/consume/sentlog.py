"""The topic against a simulator's sent-log: was every published batch written, exactly?

:class:`SentComparer` is pure: feed it the topic's records in order, ask for the
differences. ``kvbridge check --expect-sent`` and the tests use it through
:class:`~bridge.consume.checker.TopicChecker` or :func:`compare_with_sent`.
"""

from __future__ import annotations

import json
import sys
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from bridge.consume.checkreport import (
    MAX_MESSAGES,
    CheckReport,
    StreamKey,
    plural,
    runs_of,
    seq_span,
)
from bridge.log.markers import MARKER_TYPES, TAIL_END, EmptyBatch, EventsLost, PodRemoved
from bridge.log.records import Record
from bridge.log.split import PartJoiner
from bridge.ops.config import ConfigError
from bridge.vllm.decoder import DecodeError, decode_batch
from bridge.vllm.jsonview import event_to_json


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
                    f"{label}: {seq_span(lo, hi)} published but not in the topic "
                    "(no events, no EventsLost)"
                    for lo, hi in runs_of(absent)
                )
                out.extend(
                    f"{label}: {seq_span(lo, hi)} never sent by the publisher (lost), but no "
                    "EventsLost covers it"
                    for lo, hi in runs_of(uncovered)
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
                    f"{label}: topic has {plural(len(tail), 'batch', 'batches')} past the "
                    f"sent-log's end ({seq_span(tail[0], tail[-1])}): the publisher was still "
                    "running when the sent-log was read; compared up to its end"
                )
            out.extend(
                f"{label}: topic has events at {seq_span(lo, hi)}, which the sent-log does not list"
                for lo, hi in runs_of(sorted(s for s in seqs if s <= end))
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
                        f"{self._label(key, inc, epoch)}: EventsLost covers {seq_span(a, b)}, "
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
