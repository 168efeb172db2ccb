"""What `kvbridge check` found: per stream and for the whole topic, and how it is printed.

:class:`~bridge.consume.checker.TopicChecker` fills a :class:`StreamReport` per (pod, dp_rank)
stream; :class:`CheckReport` adds them up, decides ``ok`` and words the verdict and details.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from bridge.log.markers import TAIL_END

StreamKey = tuple[str, int]
MAX_MESSAGES = 1000  # violation messages kept per stream (the rest are only counted)
MAX_SAMPLES = 5  # duplicate examples kept per stream


def seq_span(lo: int, hi: int) -> str:
    return f"seq {lo}" if lo == hi else f"seqs {lo}..{hi}"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def runs_of(seqs: Iterable[int]) -> Iterator[tuple[int, int]]:
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
        dups = plural(self.duplicates, "duplicate")
        if self.duplicates and self.allow_duplicates:
            dups += " (allowed)"
        return (
            f"{plural(len(self.streams), 'stream')}, {self.events} events in "
            f"{self.batches} batches, {self.lost_batches} lost, {dups}, markers {markers}"
        )

    def verdict(self) -> str:
        """One line: ``OK: ...`` or ``FAIL: <problems> (<summary>)``."""
        if self.ok:
            return f"OK: {self._summary()}"
        problems = []
        if self.holes:
            batches = plural(self.hole_batches, "batch", "batches")
            problems.append(f"{plural(len(self.holes), 'hole')} ({batches})")
        if self.violation_count:
            problems.append(plural(self.violation_count, "violation"))
        if self.duplicates and not self.allow_duplicates:
            problems.append(plural(self.duplicates, "duplicate"))
        if self.undecodable:
            problems.append(plural(self.undecodable, "undecodable record"))
        if self.sent_differences:
            problems.append(f"{plural(len(self.sent_differences), 'difference')} from the sent-log")
        return f"FAIL: {', '.join(problems)} ({self._summary()})"

    def undecodable_details(self) -> list[str]:
        """The undecodable records: how many, then the first few (partition:offset: why)."""
        if not self.undecodable:
            return []
        out = [f"{plural(self.undecodable, 'record')} could not be decoded (skipped)"]
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
                    f"{s.name} epoch {epoch}: hole: {seq_span(lo, hi)} neither delivered nor "
                    "reported lost"
                )
            out.extend(f"{s.name}: violation: {v}" for v in s.violations)
            if s.violations_not_shown:
                out.append(f"{s.name}: ... and {s.violations_not_shown} more violations")
            if s.duplicates:
                allowed = " (allowed)" if self.allow_duplicates else ""
                eg = "; ".join(s.duplicate_samples)
                out.append(f"{s.name}: {plural(s.duplicates, 'duplicate record')}{allowed}: {eg}")
            for epoch, lo, hi, reason in s.lost_ranges:
                if hi == TAIL_END:
                    lost.append(f"{s.name} epoch {epoch}: ends after seq {lo - 1} ({reason})")
                else:
                    lost.append(f"{s.name} epoch {epoch}: lost {seq_span(lo, hi)}: {reason}")
        out.extend(self.undecodable_details())
        out.extend(f"sent-log: {d}" for d in self.sent_differences or ())
        out.extend(f"sent-log (note): {n}" for n in self.sent_notes)
        return out + lost
