"""`kvbridge check`: the command line of the topic checker (:mod:`bridge.consume.checker`)."""

from __future__ import annotations

import argparse

from bridge.cli.args import add_kafka_args, kafka_target, record_codec
from bridge.cli.progress import Progress, add_progress_arg
from bridge.consume.checker import check_topic
from bridge.consume.sentlog import SentLogError, load_sent_log
from bridge.ops.config import ConfigError

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
    add_progress_arg(p)


def run(args: argparse.Namespace) -> int:
    """`kvbridge check`: 0 if the topic is sound, 1 if not."""
    bootstrap, topic, overrides = kafka_target(args)
    sent = None
    if args.expect_sent:
        sent = load_sent_log(args.expect_sent)
        if args.pod:
            wanted = set(args.pod)
            sent = [s for s in sent if s.get("pod") in wanted]
    progress = Progress(mode=args.progress, label="check")
    try:
        report = check_topic(
            bootstrap,
            topic,
            args.allow_duplicates,
            overrides,
            pods=args.pod or None,
            codec=record_codec(args),
            sent=sent,
            progress=progress.update,
        )
    except SentLogError as exc:
        raise ConfigError(f"--expect-sent {args.expect_sent}: {exc}") from exc
    finally:
        progress.done()
    print(report.verdict())
    # Records that are not kv-events records are always listed: an operator must know.
    for line in report.details() if args.verbose else report.undecodable_details():
        print(f"  {line}")
    if not args.verbose:  # the live tail left out of the comparison: say so
        for note in report.sent_notes:
            print(f"  note: {note}")
    return 0 if report.ok else 1
