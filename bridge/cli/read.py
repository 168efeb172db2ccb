"""`kvbridge consume` and `kvbridge replay`: reading the topic from the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from bridge.cli.args import add_kafka_args, add_state_policy_arg, kafka_target, record_codec
from bridge.cli.progress import Progress, add_progress_arg
from bridge.ops.config import ConfigError, parse_duration

log = logging.getLogger("kvbridge")

CONSUME_DESCRIPTION = """\
Print the topic's records as JSON lines, each with its Kafka coordinates (partition, offset,
timestamp), the stream it belongs to (pod, dp_rank, epoch, seq, index) and the event.

  kvbridge consume --from-beginning --pod pod-a --type EventsLost
  kvbridge consume --from-timestamp 2026-12-02T16:00:00Z --to-timestamp 2026-12-02T16:05:00Z
  kvbridge consume --from-offset 0:1200,1:800 --to-offset 0:1300
  kvbridge consume --group my-tool --follow     # share the partitions with my-tool's members

--group with --follow joins the consumer group: its members split the partitions between
them (and rebalance when one joins or leaves), each partition starts at the group's committed
offset (where none is committed: the beginning, or the end with --from-end), progress is
committed every 5 s, before a partition is handed over, and at exit (Ctrl-C or SIGTERM).
Without --follow, --group reads every partition itself (no sharing) and commits at the end.
"""

REPLAY_DESCRIPTION = """\
Rebuild every (pod, DP rank) stream's prefix-cache state from the topic: the resident block
hashes per (medium, group_idx) with their parent links. Stores are idempotent, removes of
unknown hashes are ignored, AllBlocksCleared empties a stream, StreamStarted and
PublisherRestarted markers drop its state, EventsLost marks it UNCERTAIN, PodRemoved forgets
the pod. Prints a summary (default), the full state (--json), or the longest cached prefix of
a request per pod (--query); --snapshot also saves the state with the offsets it reflects.

  kvbridge replay                                            # whole topic, summary per pod
  kvbridge replay --to-timestamp 2026-12-02T16:00:00Z --snapshot state.json
  kvbridge replay --from-snapshot state.json                 # continue where it stopped
  kvbridge replay --from-snapshot state.json --snapshot state.json   # ... and move it on
  kvbridge replay --query 12345,67890,0x1f2e3d4c5b6a7988 --medium GPU
  kvbridge replay --from-offset 3:5000 --to-offset 3:9000 --pod pod-a --json
  kvbridge replay --follow --every 30s --snapshot state.json   # print + save every 30 s

--follow keeps reading: every --every seconds (10 by default) the output is printed again
(the summary or --query result after a "== replay at TIME" line; --json as one line per
document) and --snapshot is rewritten (atomically); Ctrl-C or SIGTERM prints and saves a last
time and exits 0. --group with --follow reads every partition itself (members do not share
partitions: each would hold only part of the state) and commits every 5 s and at exit.

Offsets: N (with --partition P) or P:N,P:N per partition. Times: ISO 8601 with a timezone
(2026-12-02T16:00:00Z), milliseconds since the epoch, or a duration ago (-10m, -1h30m).
Starting anywhere but the beginning (or a snapshot) sees only what changed since: blocks
stored earlier are missing. A progress bar goes to stderr when it is a terminal.
"""


def configure_reader_parser(p: argparse.ArgumentParser, name: str) -> None:
    """The options of `consume` (name="consume") or `replay` (name="replay")."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = CONSUME_DESCRIPTION if name == "consume" else REPLAY_DESCRIPTION
    add_kafka_args(p)
    where = p.add_argument_group("where to start (one of)").add_mutually_exclusive_group()
    where.add_argument(
        "--from-beginning", action="store_true", help="start at the beginning (default)"
    )
    where.add_argument("--from-end", action="store_true", help="start at the end (with --follow)")
    where.add_argument(
        "--from-offset",
        metavar="OFFSETS",
        help="start at offset N of --partition P, or at P:N,P:N (only the partitions named)",
    )
    where.add_argument(
        "--from-timestamp",
        metavar="TIME",
        help="start at the first record at/after TIME, in every partition",
    )
    if name == "replay":
        where.add_argument(
            "--from-snapshot",
            metavar="FILE",
            help="load a state saved with --snapshot, then continue from the offsets it reflects",
        )
    where.add_argument(
        "--from-committed",
        action="store_true",
        help="start at --group's committed offsets (the default when --group is given)",
    )
    stop = p.add_argument_group("where to stop (default: the end when reading began)")
    stop.add_argument(
        "--to-offset",
        metavar="OFFSETS",
        help="stop after offset N (of --partition P, else of every partition), or P:N,P:N",
    )
    stop.add_argument(
        "--to-timestamp", metavar="TIME", help="stop after the last record at or before TIME"
    )
    stop.add_argument(
        "--follow",
        action="store_true",
        help="keep reading new records (Ctrl-C or SIGTERM stops)"
        + (", printing the state every --every" if name == "replay" else ""),
    )
    if name == "replay":
        stop.add_argument(
            "--every",
            metavar="SECONDS",
            help="with --follow: print the output again (and rewrite --snapshot) every "
            "SECONDS, e.g. 30 or 30s or 1m (default 10)",
        )
    p.add_argument("--partition", type=int, metavar="P", help="partition of --from/--to-offset N")
    p.add_argument("--pod", action="append", default=[], help="only these pods (repeatable)")
    p.add_argument(
        "--group",
        metavar="ID",
        help="consumer group: start at its committed offsets and commit what was read (at "
        "the end, and every 5 s with --follow)"
        + (
            "; with --follow, members share the partitions (see above)" if name == "consume" else ""
        ),
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])
    if name == "consume":
        p.add_argument(
            "--type",
            action="append",
            default=[],
            metavar="TYPE",
            help="only these event/marker types, e.g. BlockStored, EventsLost (repeatable)",
        )
        p.add_argument("--max", type=int, metavar="N", help="stop after N records")
        return
    out = p.add_argument_group("output (default: a summary per pod and rank)")
    out.add_argument(
        "--json", action="store_true", help="print the full state (every block) as JSON"
    )
    out.add_argument(
        "--query",
        metavar="HASHES",
        help="a request's block hashes in order, comma-separated (decimal 64-bit keys as "
        "vLLM sends them, or hex digests/keys with 0x); prints the longest cached prefix "
        "per pod and rank",
    )
    out.add_argument("--medium", help="with --query: only this tier, e.g. GPU")
    add_state_policy_arg(p)
    out.add_argument(
        "--snapshot",
        metavar="FILE",
        help="also save the state and the offsets it reflects (continue with --from-snapshot)",
    )
    add_progress_arg(out)


def parse_time(text: str, flag: str = "--from-timestamp") -> int:
    """Milliseconds since the epoch from ISO 8601 (with a timezone), ms, or -DURATION (ago)."""
    t = text.strip()
    if t.isdigit():
        return int(t)
    if t.startswith("-"):
        try:
            return int((time.time() - parse_duration(t[1:])) * 1000)
        except ValueError:
            pass
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r}: expected ISO 8601 (2026-12-02T16:00:00Z), ms since the epoch, "
            "or a duration ago (-10m)"
        ) from None
    if dt.tzinfo is None:
        raise ConfigError(f"{flag} {text!r}: add a timezone, e.g. Z or +00:00")
    return int(dt.timestamp() * 1000)


def parse_offsets(text: str, partition: int | None, flag: str) -> dict[int, int] | int:
    """``N`` (of ``partition``, or of every partition when None: returned as an int) or
    ``P:N,P:N`` ({partition: offset})."""
    t = text.strip()
    try:
        if ":" not in t:
            n = int(t)
            if n < 0:
                raise ValueError
            return n if partition is None else {partition: n}
        out: dict[int, int] = {}
        for part in filter(None, (x.strip() for x in t.split(","))):
            p, _, n = part.partition(":")
            if int(p) < 0 or int(n) < 0:
                raise ValueError
            out[int(p)] = int(n)
        if not out:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r}: expected an offset N (with --partition P) or P:N,P:N, all >= 0"
        ) from None
    if partition is not None:
        raise ConfigError(f"{flag} {text!r} names its partitions: drop --partition")
    return out


def reader_args(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(TopicReader, StartAt, StopAt | None) from the consume/replay options."""
    from bridge.consume.reader import StartAt, StopAt, TopicReader

    bootstrap, topic, overrides = kafka_target(args)
    if args.from_offset is not None:
        offsets = parse_offsets(args.from_offset, args.partition, "--from-offset")
        if isinstance(offsets, int):
            raise ConfigError("--from-offset N needs --partition P (offsets are per partition)")
        start = StartAt.at_offsets(offsets)
    elif args.from_timestamp:
        start = StartAt.at_timestamp(parse_time(args.from_timestamp, "--from-timestamp"))
    elif args.from_end:
        start = StartAt.end()
    elif args.from_committed or (args.group and not args.from_beginning):
        if not args.group:
            raise ConfigError("--from-committed needs --group ID")
        start = StartAt.committed()
    else:
        start = StartAt.beginning()
    stop_offsets: dict[int, int] | None = None
    to_all: int | None = None
    if args.to_offset is not None:
        parsed = parse_offsets(args.to_offset, args.partition, "--to-offset")
        if isinstance(parsed, int):
            to_all = parsed
        else:
            stop_offsets = parsed
    to_ts = parse_time(args.to_timestamp, "--to-timestamp") if args.to_timestamp else None
    stop = None
    if stop_offsets or to_all is not None or to_ts is not None:
        stop = StopAt(offsets=stop_offsets, timestamp_ms=to_ts, offset=to_all)
    reader = TopicReader(bootstrap, topic, overrides, group_id=args.group, codec=record_codec(args))
    return reader, start, stop


@contextlib.contextmanager
def sigterm_stops(active: bool) -> Iterator[None]:
    """While following, SIGTERM stops like Ctrl-C: commit, last output, exit 0."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def final_commit(reader: Any) -> int:
    """Commit at exit: 0, or 1 (logged) when the broker refuses."""
    from confluent_kafka import KafkaException

    try:
        reader.commit()
    except KafkaException as exc:
        log.error(
            "could not commit the group's offsets at exit (%s); it will re-read from its "
            "previous commit",
            exc,
        )
        return 1
    return 0


def cmd_consume(args: argparse.Namespace) -> int:
    from bridge.vllm.jsonview import event_to_json

    shared = bool(args.group and args.follow)
    if shared and (args.from_offset or args.from_timestamp or args.to_offset or args.to_timestamp):
        raise ConfigError(
            "--group with --follow shares the partitions with the group's other members and "
            "starts each at the group's committed offset: --from-offset, --from-timestamp, "
            "--to-offset and --to-timestamp do not apply (use --from-beginning or --from-end "
            "for partitions without a commit, or drop --follow to read every partition)"
        )
    reader, start, stop = reader_args(args)
    pods, types = set(args.pod), set(args.type)
    n = 0
    out = sys.stdout
    reader.before_commit = out.flush  # what a commit vouches for is printed
    last_commit = time.monotonic()

    def tick() -> None:
        nonlocal last_commit
        if args.group and args.follow and time.monotonic() - last_commit >= 5.0:
            reader.commit(asynchronous=True)
            last_commit = time.monotonic()

    rc = 0
    with reader, sigterm_stops(args.follow):
        try:
            if shared:
                records = reader.read_group(start, tick=tick)
            else:
                records = reader.read(start, follow=args.follow, stop=stop, tick=tick)
            for cr in records:
                env, ev = cr.record.envelope, cr.record.event
                name = type(ev).__name__
                if (pods and env.pod not in pods) or (types and name not in types):
                    continue
                line = {
                    "partition": cr.partition,
                    "offset": cr.offset,
                    "timestamp": cr.timestamp_ms,
                    "pod": env.pod,
                    "model": env.model,
                    "dp_rank": env.dp_rank,
                    "epoch": env.epoch,
                    "seq": env.seq,
                    "index": env.index,
                    "ts": env.ts,
                    "type": name,
                    "event": event_to_json(ev),
                }
                if env.batch_extra:
                    line["batch_extra"] = {k: v.hex() for k, v in env.batch_extra.items()}
                out.write(json.dumps(line) + "\n")
                n += 1
                if args.max is not None and n >= args.max:
                    break
        except KeyboardInterrupt:
            if not args.follow:
                raise
        out.flush()
        if args.group:
            rc = final_commit(reader)
        report_undecodable(reader)
    return rc


def parse_query(text: str) -> list[int]:
    """Block hashes as vLLM's 64-bit keys (:func:`bridge.vllm.events.parse_hash_text`): ``0x`` hex
    of a key or a digest, as consume and replay print them, or decimal keys."""
    from bridge.vllm.events import parse_hash_text

    keys = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            keys.append(parse_hash_text(part))
        except ValueError as exc:
            raise ConfigError(
                f"--query: {exc}; give hashes as consume prints them (0x...) or decimal keys "
                "(as vLLM sends them), separated by commas"
            ) from None
    if not keys:
        raise ConfigError("--query needs at least one block hash")
    return keys


def replay_every(args: argparse.Namespace) -> float | None:
    """Seconds between outputs while following (None without --follow)."""
    if args.every is None:
        return 10.0 if args.follow else None
    if not args.follow:
        raise ConfigError("--every prints the state again while following: add --follow")
    try:
        every = parse_duration(args.every)
    except ValueError as exc:
        raise ConfigError(f"--every: {exc}") from None
    if every <= 0:
        raise ConfigError(f"--every {args.every!r}: give a positive number of seconds, e.g. 10")
    return every


def report_undecodable(reader: Any) -> None:
    """At the end of a read: how many records could not be decoded, and where the first are."""
    u = reader.undecodable
    if u.count:
        log.warning(
            "%d records of %s could not be decoded and were skipped (not kv-events records: "
            "a tombstone, another producer's bytes, an unknown schema); first: %s",
            u.count,
            u.topic,
            "; ".join(u.samples()),
        )


def print_state(
    state: Any, args: argparse.Namespace, keys: list[int] | None, undecodable: int = 0
) -> None:
    """The summary, the --json document or the --query result, on stdout. While following,
    a "== replay at TIME" line comes first and --json is one line per document."""
    out = sys.stdout
    if args.follow and not args.json:
        now = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        out.write(f"== replay at {now}\n")
    if keys is not None:
        matches = state.prefix_match(keys, args.medium)
        ranked = sorted(matches.items(), key=lambda kv: (-kv[1], kv[0]))
        out.write(f"{'pod':<20} {'rank':>4} {'prefix':>7} of {len(keys)} blocks\n")
        for (pod, rank), n in ranked:
            flag = "  UNCERTAIN" if state.streams[(pod, rank)].uncertain else ""
            out.write(f"{pod:<20} {rank:>4} {n:>7}{flag}\n")
    elif args.json:
        if args.follow:
            out.write(json.dumps(state.to_json(), separators=(",", ":")) + "\n")
        else:
            json.dump(state.to_json(), out, indent=1)
            out.write("\n")
    else:
        s = state.summary()
        out.write(
            f"records applied: {s['records_applied']}   duplicates skipped: "
            f"{s['duplicates_skipped']}   markers: {s['markers'] or 'none'}"
            + (f"   undecodable skipped: {undecodable}" if undecodable else "")
            + (f"   stale epochs skipped: {s['stale_skipped']}" if s["stale_skipped"] else "")
            + f"   policy: {s['policy']}\n"
        )
        out.write(
            f"{'pod':<20} {'rank':>4} {'epoch':>14} {'last_seq':>9} {'blocks':>8}  "
            "by medium / notes\n"
        )
        for e in s["streams"]:
            notes = ", ".join(f"{k}={v}" for k, v in e["blocks_by_medium"].items())
            if e["uncertain"]:
                notes += f"  UNCERTAIN ({e['lost_batches']} batches lost)"
            last = "-" if e["last_seq"] is None else e["last_seq"]
            row = (
                f"{e['pod']:<20} {e['dp_rank']:>4} {e['epoch']!s:>14} {last!s:>9} {e['blocks']:>8}"
            )
            out.write(f"{row}  {notes}\n")
    out.flush()


def cmd_replay(args: argparse.Namespace) -> int:
    from bridge.consume.reader import StartAt
    from bridge.consume.state import DEFAULT_POLICY, CacheState, SnapshotError

    keys = parse_query(args.query) if args.query is not None else None
    every = replay_every(args)
    state = CacheState(args.state_policy or DEFAULT_POLICY)
    snap_offsets: dict[int, int] = {}
    if args.from_snapshot:
        try:
            state, snap_topic, snap_offsets = CacheState.load(args.from_snapshot, args.state_policy)
        except SnapshotError as exc:
            raise ConfigError(str(exc)) from None
        _, topic, _ = kafka_target(args)
        if args.topic and args.topic != snap_topic:
            raise ConfigError(
                f"snapshot {args.from_snapshot} reflects topic {snap_topic!r}, not {args.topic!r}"
            )
        args.topic = snap_topic
    reader, start, stop = reader_args(args)
    pods = set(args.pod)
    progress = Progress(reader.progress, args.progress)
    now = time.monotonic()
    last_commit = last_output = now

    def save_snapshot() -> dict[int, int]:
        offsets = {p: o for p, o in snap_offsets.items() if o >= 0}
        offsets.update(reader.next_offsets)
        state.save(args.snapshot, reader.topic, offsets)
        return offsets

    def tick() -> None:
        nonlocal last_commit, last_output
        now = time.monotonic()
        if args.group and args.follow and now - last_commit >= 5.0:
            reader.commit(asynchronous=True)
            last_commit = now
        if every is not None and now - last_output >= every:
            last_output = now
            if args.snapshot:
                save_snapshot()
            progress.clear()
            print_state(state, args, keys, reader.skipped)

    rc = 0
    with reader, sigterm_stops(args.follow):
        if args.from_snapshot:
            offsets = dict(snap_offsets)
            for p in reader.partitions():
                offsets.setdefault(p, -2)  # a partition added since: from its beginning
            start = StartAt.at_offsets(offsets)
        idle = 1.0 if every is None else min(1.0, every / 2)
        try:
            for cr in reader.read(
                start, follow=args.follow, stop=stop, idle_timeout=idle, tick=tick
            ):
                progress.tick()
                if pods and cr.record.envelope.pod not in pods:
                    continue
                state.apply(cr.record)
        except KeyboardInterrupt:
            if not args.follow:
                raise
        finally:
            progress.done()
        if args.group:
            rc = final_commit(reader)
        report_undecodable(reader)
        if args.snapshot:
            offsets = save_snapshot()
            log.info(
                "snapshot %s: %d streams, %d blocks, offsets %s",
                args.snapshot,
                len(state.streams),
                state.resident_blocks(),
                ",".join(f"{p}:{o}" for p, o in sorted(offsets.items())),
            )
    print_state(state, args, keys, reader.skipped)
    return rc
