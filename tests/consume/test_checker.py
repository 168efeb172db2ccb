"""The topic checker: every contract rule, and the sent-log comparison (`kvbridge check`'s
command line: tests/cli/test_check.py)."""

from __future__ import annotations

import json

import pytest
from checker_util import (
    E1,
    E2,
    E3,
    batch,
    batches,
    env,
    lost,
    produce,
    removed,
    restarted,
    scenario,
    sent_entry,
    started,
    stored,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.consume.checker import TopicChecker, check_topic
from bridge.consume.checkreport import CheckReport
from bridge.consume.reader import ConsumedRecord
from bridge.consume.sentlog import SentComparer, SentLogError, compare_with_sent, load_sent_log
from bridge.log.markers import EventsLost, PublisherRestarted, StreamStarted
from bridge.log.records import Record
from bridge.ops.config import ConfigError
from bridge.vllm.events import AllBlocksCleared, BlockRemoved


def check(records: list[Record], allow_duplicates: bool = False) -> CheckReport:
    checker = TopicChecker(allow_duplicates)
    for r in records:
        checker.add(r)
    return checker.report()


def only(report: CheckReport):
    assert len(report.streams) == 1
    return next(iter(report.streams.values()))


def assert_violation(report: CheckReport, *fragments: str) -> None:
    assert not report.ok
    assert any(all(f in v for f in fragments) for v in report.violations), report.violations


# ------------------------------------------------------------------ the rules


def test_clean_stream_is_ok_with_exact_totals():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(5), n=3)
    recs += batch("a", 0, E1, 5, n=1)
    r = check(recs)
    assert r.ok, r.details()
    s = only(r)
    assert (s.epochs, s.events, s.batches, s.lost_batches, s.duplicates) == (1, 16, 6, 0, 0)
    assert s.holes == [] and s.violations == [] and s.markers == {"StreamStarted": 1}
    assert r.records == 17
    assert r.verdict() == (
        "OK: 1 stream, 16 events in 6 batches, 0 lost, 0 duplicates, markers StreamStarted=1"
    )
    assert r.details() == []


def test_every_event_type_counts_as_an_event():
    evs = [stored(0, 0), BlockRemoved([b"\x00" * 8]), AllBlocksCleared()]
    recs = [started("a", 0, E1)] + [Record(env("a", 0, E1, 0, i), e) for i, e in enumerate(evs)]
    s = only(check(recs))
    assert (s.events, s.batches) == (3, 1)


def test_hole_is_reported_with_epoch_and_range():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0, 1, 4, 5])
    r = check(recs)
    assert only(r).holes == [(E1, 2, 3)]
    assert r.holes == [("a", 0, E1, 2, 3)]
    assert not r.ok
    assert r.verdict().startswith("FAIL: 1 hole (2 batches) (1 stream, 8 events in 4 batches")
    assert r.details() == [
        f"a rank 0 epoch {E1}: hole: seqs 2..3 neither delivered nor reported lost"
    ]


def test_hole_at_the_start_of_an_epoch():
    r = check([started("a", 0, E1)] + batches("a", 0, E1, [1, 2]))
    assert only(r).holes == [(E1, 0, 0)]


def test_gap_covered_by_events_lost_is_ok():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0, 1])
    recs += [lost("a", 0, E1, 2, 4, "not in replay buffer")] + batches("a", 0, E1, [5])
    r = check(recs)
    assert r.ok, r.details()
    s = only(r)
    assert s.lost_batches == 3 and s.lost_ranges == [(E1, 2, 4, "not in replay buffer")]
    assert s.markers == {"StreamStarted": 1, "EventsLost": 1}
    assert "3 lost" in r.verdict()
    assert r.details() == [f"a rank 0 epoch {E1}: lost seqs 2..4: not in replay buffer"]


def test_events_lost_at_the_end_extends_the_account():
    # The loss itself names the highest seq: nothing after it, no hole.
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0]) + [lost("a", 0, E1, 1, 3)]
    assert check(recs).ok
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0]) + [lost("a", 0, E1, 2, 3)]
    assert only(check(recs)).holes == [(E1, 1, 1)]


def test_double_loss_is_a_violation():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0])
    recs += [lost("a", 0, E1, 1, 4), lost("a", 0, E1, 3, 6, "replay incomplete")]
    r = check(recs)
    assert_violation(r, f"epoch {E1}", "seqs 3..4 reported lost twice")
    assert only(r).holes == []


def test_delivered_and_lost_is_a_violation():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(4)) + [lost("a", 0, E1, 2, 5)]
    r = check(recs)
    assert_violation(r, f"epoch {E1}", "seqs 2..3 delivered and also reported lost")
    assert r.verdict().startswith("FAIL: 1 violation (")


def test_identical_events_lost_repeated_is_a_duplicate_not_a_double_loss():
    recs = [started("a", 0, E1), lost("a", 0, E1, 0, 2), lost("a", 0, E1, 0, 2)]
    recs += batches("a", 0, E1, [3])
    r = check(recs)
    s = only(r)
    assert s.duplicates == 1 and s.violations == [] and s.lost_batches == 3
    assert check(recs, allow_duplicates=True).ok


def test_duplicate_event_fails_unless_allowed():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(3))
    recs += batch("a", 0, E1, 1)  # the whole batch again (at-least-once after a crash)
    r = check(recs)
    s = only(r)
    assert s.duplicates == 2 and s.events == 6 and s.batches == 3 and s.violations == []
    assert not r.ok
    assert r.verdict().startswith("FAIL: 2 duplicates (")
    assert any("2 duplicate records" in d and f"epoch {E1} seq 1 index 0" in d for d in r.details())
    ok = check(recs, allow_duplicates=True)
    assert ok.ok
    assert "2 duplicates (allowed)" in ok.verdict() and ok.verdict().startswith("OK: ")


def test_duplicate_index_within_a_batch():
    recs = [started("a", 0, E1)] + batch("a", 0, E1, 0, n=2)
    recs += [Record(env("a", 0, E1, 0, 1), stored(0, 1))] + batches("a", 0, E1, [1])
    assert only(check(recs)).duplicates == 1


def test_identical_marker_repeated_is_a_duplicate():
    recs = [started("a", 0, E1), started("a", 0, E1)] + batches("a", 0, E1, [0])
    s = only(check(recs))
    assert s.duplicates == 1 and s.violations == [] and s.markers == {"StreamStarted": 1}


def test_marker_timestamp_is_not_part_of_its_identity():
    again = started("a", 0, E1)
    again.envelope.ts += 5.0  # written again by a restarted bridge, at another time
    assert only(check([started("a", 0, E1), again])).duplicates == 1


def test_different_stream_started_for_the_same_epoch_is_a_violation():
    other = Record(env("a", 0, E1, 0, -1), StreamStarted(0, "tcp://elsewhere:5557"))
    r = check([started("a", 0, E1), other] + batches("a", 0, E1, [0]))
    assert_violation(r, f"epoch {E1}", "StreamStarted opens it again")


def test_epoch_without_opening_marker():
    r = check(batches("a", 0, E1, range(3)))
    assert_violation(r, f"epoch {E1} seq 0", "event before any StreamStarted/PublisherRestarted")
    assert only(r).violation_count == 1  # once per epoch, not once per record
    assert only(r).holes == []


def test_events_lost_without_opening_marker():
    r = check([lost("a", 0, E1, 0, 3)] + batches("a", 0, E1, [4]))
    assert_violation(r, "EventsLost before any StreamStarted")


def test_new_epoch_without_publisher_restarted():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(3)) + batches("a", 0, E2, range(2))
    assert_violation(check(recs), f"epoch {E2} seq 0: event before any StreamStarted")


def test_publisher_restart_opens_a_new_epoch():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(5))
    recs += [restarted("a", 0, E2, E1, 4, first=0)] + batches("a", 0, E2, range(3))
    r = check(recs)
    assert r.ok, r.details()
    s = only(r)
    assert (s.epochs, s.batches, s.events) == (2, 8, 16)
    assert s.markers == {"StreamStarted": 1, "PublisherRestarted": 1}


def test_restart_with_loss_before_and_after():
    # Old epoch: 3..4 lost (publisher restarted); new epoch: live seq 2 revealed it, 0..1 lost.
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(3))
    recs += [lost("a", 0, E1, 3, 4, "publisher restarted"), restarted("a", 0, E2, E1, 2, first=2)]
    recs += [lost("a", 0, E2, 0, 1, "not in replay buffer")] + batches("a", 0, E2, [2, 3])
    r = check(recs)
    assert r.ok, r.details()
    assert only(r).lost_ranges == [
        (E1, 3, 4, "publisher restarted"),
        (E2, 0, 1, "not in replay buffer"),
    ]


def test_publisher_restarted_last_seq_reveals_a_missing_tail():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(3))
    recs += [restarted("a", 0, E2, E1, 5)] + batches("a", 0, E2, range(2))
    assert only(check(recs)).holes == [(E1, 3, 5)]


def test_publisher_restarted_last_seq_below_delivered_events():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(4))
    recs += [restarted("a", 0, E2, E1, 1)]
    assert_violation(check(recs), f"epoch {E1}: events up to seq 3", "last delivered seq was 1")
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(2)) + [restarted("a", 0, E2, E1, None)]
    assert_violation(check(recs), "says no batch was delivered")


def test_publisher_restarted_must_move_forward_from_the_current_epoch():
    recs = [started("a", 0, E2)] + batches("a", 0, E2, [0]) + [restarted("a", 0, E1, E2, 0)]
    assert_violation(check(recs), f"epoch {E1}: PublisherRestarted goes back from epoch {E2}")
    recs = [started("a", 0, E2)] + batches("a", 0, E2, [0]) + [restarted("a", 0, E3, E1, 0)]
    assert_violation(check(recs), f"names old epoch {E1}", f"was in epoch {E2}")


def test_publisher_restarted_as_the_first_record_is_a_violation():
    r = check([restarted("a", 0, E2, E1, 3)] + batches("a", 0, E2, [0]))
    assert_violation(r, "PublisherRestarted", "expected StreamStarted")


def test_smaller_epoch_after_a_bigger_one_is_a_violation():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0])
    recs += [restarted("a", 0, E2, E1, 0)] + batches("a", 0, E2, [0])
    recs += batches("a", 0, E1, [1])  # new data for the old epoch
    r = check(recs)
    assert_violation(r, f"epoch {E1} seq 1: event of epoch {E1}", f"in epoch {E2}")


def test_bridge_restart_may_open_any_epoch_with_stream_started():
    # A bridge restarted without checkpoints: a new StreamStarted epoch, even a smaller one
    # (another host's clock), replaying the publisher's ring from seq 0 again.
    recs = [started("a", 0, E3)] + batches("a", 0, E3, range(4))
    recs += [started("a", 0, E1)] + batches("a", 0, E1, range(6))
    r = check(recs)
    assert r.ok, r.details()
    assert only(r).epochs == 2 and only(r).markers == {"StreamStarted": 2}


def test_stream_started_reopening_an_old_epoch_is_a_violation():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0])
    recs += [started("a", 0, E2)] + batches("a", 0, E2, [0])
    recs += [Record(env("a", 0, E1, 1, -1), StreamStarted(1, "tcp://a:5557"))]
    assert_violation(check(recs), f"epoch {E1}: StreamStarted opens it again")


def test_late_first_contact_events_lost_at_the_start():
    recs = [started("a", 0, E1), lost("a", 0, E1, 0, 99, "before first contact")]
    recs += batches("a", 0, E1, range(100, 103))
    r = check(recs)
    assert r.ok, r.details()
    assert only(r).lost_batches == 100 and only(r).batches == 3


def test_stream_started_next_seq_is_the_start_of_the_account():
    recs = [started("a", 0, E1, next_seq=10)] + batches("a", 0, E1, range(10, 13))
    assert check(recs).ok
    recs = [started("a", 0, E1, next_seq=10)] + batches("a", 0, E1, [3])
    assert_violation(check(recs), "seq 3 is below the epoch's first seq 10")


def test_pod_removed_then_a_new_stream_started():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, range(3)) + [removed("a", 0, E1)]
    recs += [started("a", 0, E2)] + batches("a", 0, E2, range(2))
    r = check(recs)
    assert r.ok, r.details()
    assert only(r).markers == {"StreamStarted": 2, "PodRemoved": 1}


def test_pod_removed_ends_every_rank_of_the_pod_only():
    recs = [started("a", 0, E1), started("a", 1, E1), started("b", 0, E1)]
    recs += batches("a", 0, E1, [0]) + batches("a", 1, E1, [0]) + batches("b", 0, E1, [0])
    recs += [removed("a", 0, E1)]
    recs += batches("a", 1, E1, [1]) + batches("b", 0, E1, [1])
    r = check(recs)
    assert {v.split(":")[0] for v in r.violations} == {"a rank 1"}
    assert_violation(r, f"epoch {E1} seq 1: event of epoch {E1}, but the pod was removed")


def test_pod_removed_then_records_without_stream_started():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0]) + [removed("a", 0, E1)]
    recs += batches("a", 0, E2, [0])
    assert_violation(check(recs), f"epoch {E2} seq 0", "the pod was removed")


def test_interleaved_streams_of_two_pods_and_two_ranks():
    keys = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    recs = [started(p, k, E1) for p, k in keys]
    for seq in range(6):
        for p, k in keys:
            if (p, k) == ("b", 1) and seq == 3:
                continue  # one hole, in one stream only
            recs += batch(p, k, E1, seq, n=1 + seq % 3)
    r = check(recs)
    assert set(r.streams) == set(keys)
    assert r.holes == [("b", 1, E1, 3, 3)]
    assert r.violation_count == 0
    assert [r.streams[k].batches for k in keys] == [6, 6, 6, 5]
    assert r.verdict().startswith("FAIL: 1 hole (1 batch) (4 streams, ")


def test_out_of_order_seq_is_a_violation():
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0, 2, 1, 3])
    r = check(recs)
    assert_violation(r, f"epoch {E1}: seq 1 arrives after seq 2")
    assert only(r).holes == [] and only(r).batches == 4


def test_index_rules():
    skip = [Record(env("a", 0, E1, 0, i), stored(0, i)) for i in (0, 1, 3)]
    assert_violation(check([started("a", 0, E1), *skip]), "index 3 follows index 1", "2..2")
    late = [Record(env("a", 0, E1, 1, 2), stored(1, 2))]
    assert_violation(check([started("a", 0, E1), *late]), "first event has index 2")
    resumed = batches("a", 0, E1, [0, 1]) + [Record(env("a", 0, E1, 0, 2), stored(0, 2))]
    assert_violation(check([started("a", 0, E1), *resumed]), "seq 0: index 2 arrives after other")


def test_marker_and_event_index_mismatch():
    bad = Record(env("a", 0, E1, 0, 0), StreamStarted(0, "x"))
    assert_violation(check([bad]), "marker StreamStarted with index 0")
    bad = Record(env("a", 0, E1, 0, -1), stored(0, 0))
    assert_violation(check([started("a", 0, E1), bad]), "BlockStored with index -1")


def test_resent_records_across_an_epoch_change_are_duplicates():
    # At-least-once: a crashed bridge re-sends from a checkpoint in the old epoch.
    first = [started("a", 0, E1)] + batches("a", 0, E1, range(4))
    second = [restarted("a", 0, E2, E1, 3)] + batches("a", 0, E2, range(2))
    recs = first + second + batches("a", 0, E1, [2, 3]) + second + batches("a", 0, E2, [2])
    r = check(recs, allow_duplicates=True)
    assert r.ok, r.details()
    assert only(r).duplicates == 9 and only(r).batches == 7


def test_report_is_incremental():
    checker = TopicChecker()
    for rec in [started("a", 0, E1)] + batches("a", 0, E1, [0, 2]):
        checker.add(rec)
    assert checker.report().holes == [("a", 0, E1, 1, 1)]
    for rec in batches("a", 0, E1, [1]):
        checker.add(rec)  # late and out of order: no longer a hole, but a violation
    r = checker.report()
    assert r.holes == [] and r.violation_count == 1


def test_undecodable_records_fail_the_check():
    checker = TopicChecker()
    for rec in [started("a", 0, E1)] + batches("a", 0, E1, [0]):
        checker.add(rec)
    checker.undecodable = 2
    r = checker.report()
    assert not r.ok and r.verdict().startswith("FAIL: 2 undecodable records (")


# ------------------------------------------------------------------ property: valid plans


@st.composite
def plans(draw: st.DrawFn) -> list[Record]:
    """A valid topic for one stream, as the bridge writes it: epochs, losses, restarts."""
    recs = [started("p", 0, E1)]
    epoch, last_delivered = E1, None
    for n_epoch in range(draw(st.integers(1, 3))):
        if n_epoch:
            recs.append(restarted("p", 0, epoch + 1, epoch, last_delivered))
            epoch, last_delivered = epoch + 1, None
        seq = 0
        for _ in range(draw(st.integers(1, 8))):
            if draw(st.booleans()):
                k = draw(st.integers(1, 3))
                recs.append(lost("p", 0, epoch, seq, seq + k - 1))
                seq += k
            else:
                recs += batch("p", 0, epoch, seq, draw(st.integers(1, 3)))
                last_delivered = seq
                seq += 1
    return recs


@settings(max_examples=150, deadline=None)
@given(plans(), st.data())
def test_valid_plans_pass_and_damage_is_caught(recs: list[Record], data: st.DataObject) -> None:
    assert check(recs).ok, check(recs).details()
    # A record written twice: a duplicate, and only that.
    i = data.draw(st.integers(0, len(recs) - 1))
    r = check(recs[: i + 1] + [recs[i]] + recs[i + 1 :])
    assert only(r).duplicates == 1 and r.violation_count == 0 and r.holes == []
    # A delivered batch removed, when a later record of the epoch follows it: detected.
    events = [r for r in recs if r.envelope.index == 0]
    if not events:
        return
    victim = data.draw(st.sampled_from(events)).envelope
    kept = [
        r
        for r in recs
        if (r.envelope.epoch, r.envelope.seq) != (victim.epoch, victim.seq) or r.envelope.index < 0
    ]
    later = any(
        (r.envelope.epoch == victim.epoch and r.envelope.seq > victim.seq)
        or (isinstance(r.event, PublisherRestarted) and r.event.old_epoch == victim.epoch)
        for r in kept
    )
    if later:
        assert (victim.epoch, victim.seq, victim.seq) in only(check(kept)).holes


# ------------------------------------------------------------------ compare_with_sent


def test_compare_with_sent_agrees():
    recs, sent = scenario()
    assert check(recs).ok
    assert compare_with_sent(recs, sent) == []
    consumed = [ConsumedRecord(0, i, 0, r) for i, r in enumerate(recs)]
    assert compare_with_sent(iter(consumed), sent) == []


def test_compare_with_sent_ignores_duplicates_and_accepts_losses_of_published_batches():
    recs, sent = scenario()
    assert compare_with_sent(recs[:6] + recs[2:6] + recs[6:], sent) == []  # seqs 0, 1 again
    # Batch 4 published, but the bridge reported it lost: fine (the topic says so).
    e1s4 = (0, E1, 4)
    recs = [r for r in recs if (r.envelope.dp_rank, r.envelope.epoch, r.envelope.seq) != e1s4]
    recs.append(lost("a", 0, E1, 4, 4, "replay timed out"))
    assert compare_with_sent(recs, sent) == []


def test_compare_with_sent_event_differs():
    recs, sent = scenario()
    sent[1]["events"][1]["token_ids"] = [7, 7, 7, 7]
    diffs = compare_with_sent(recs, sent)
    assert len(diffs) == 1
    assert diffs[0].startswith(f"a rank 0 incarnation 0 (epoch {E1}) seq 1 index 1: BlockStored")
    assert "token_ids: topic [1, 2, 3, 4], sent [7, 7, 7, 7]" in diffs[0]


def test_compare_with_sent_missing_batches_and_events():
    recs, sent = scenario()
    recs = [r for r in recs if not (r.envelope.epoch == E2 and r.envelope.seq >= 1)]
    e = (0, E1, 0, 1)
    recs = [r for r in recs if (r.envelope.dp_rank, r.envelope.epoch, r.envelope.seq,
                                r.envelope.index) != e]  # fmt: skip
    assert compare_with_sent(recs, sent) == [
        f"a rank 0 incarnation 0 (epoch {E1}) seq 0: topic has 1 of the batch's 2 events",
        f"a rank 0 incarnation 1 (epoch {E2}): seqs 1..2 published but not in the topic "
        "(no events, no EventsLost)",
    ]


def test_compare_with_sent_lost_batch_needs_events_lost():
    recs, sent = scenario()
    recs = [r for r in recs if not isinstance(r.event, EventsLost)]
    diffs = compare_with_sent(recs, sent)
    assert diffs == [
        f"a rank 0 incarnation 0 (epoch {E1}): seq 3 never sent by the publisher (lost), "
        "but no EventsLost covers it"
    ]


def test_compare_with_sent_topic_has_more_than_was_sent():
    recs, sent = scenario()
    recs += batches("a", 0, E2, [3, 4]) + [lost("a", 0, E2, 5, 6)]
    recs += [started("z", 0, E1)] + batches("z", 0, E1, [0], n=1)
    cmp = SentComparer(sent)
    for r in recs:
        cmp.add(r)
    # A stream the sent-log does not list differs; batches past the end of a stream's last
    # logged incarnation are the live tail of a publisher still running: not compared, noted.
    assert cmp.differences() == [
        f"z rank 0 incarnation 0 (epoch {E1}): topic has events at seq 0, which the sent-log "
        "does not list",
    ]
    assert cmp.notes == [
        f"a rank 0 incarnation 1 (epoch {E2}): topic has 2 batches past the sent-log's end "
        "(seqs 3..4): the publisher was still running when the sent-log was read; compared up "
        "to its end"
    ]
    # Past the end of an incarnation that ended (a later one is logged): a real difference.
    recs2, sent2 = scenario()
    recs2 += batches("a", 0, E1, [5], n=1)
    assert any(
        "seq 5, which the sent-log does not list" in d for d in compare_with_sent(recs2, sent2)
    )


def test_compare_with_sent_extra_event_in_a_batch():
    recs, sent = scenario()
    recs.insert(4, Record(env("a", 0, E1, 0, 2), stored(0, 2)))  # after seq 0's two events
    diffs = compare_with_sent(recs, sent)
    assert diffs == [
        f"a rank 0 incarnation 0 (epoch {E1}) seq 0: topic has index 2; the batch had 2 events"
    ]


def test_compare_with_sent_a_stream_missing_from_the_topic():
    recs, sent = scenario()
    recs = [r for r in recs if r.envelope.dp_rank == 0]
    assert compare_with_sent(recs, sent) == [
        "a rank 1 incarnation 0 (no epoch in the topic): seq 0 published but not in the "
        "topic (no events, no EventsLost)"
    ]


def test_compare_with_sent_rejects_a_malformed_log_and_a_report():
    with pytest.raises(SentLogError, match="entry 1"):
        SentComparer([{"pod": "a"}])
    with pytest.raises(SentLogError, match="sent='maybe'"):
        SentComparer([dict(sent_entry("a", 0, 0, 0), sent="maybe")])
    with pytest.raises(SentLogError, match="appears twice"):
        SentComparer([sent_entry("a", 0, 0, 0)] * 2)
    recs, sent = scenario()
    with pytest.raises(TypeError, match="needs the records"):
        compare_with_sent(check(recs), sent)


def test_checker_with_sent_log_reports_differences_in_the_verdict():
    recs, sent = scenario()
    checker = TopicChecker(sent=sent[:-1])  # the log lacks rank 1's batch
    for r in recs:
        checker.add(r)
    rep = checker.report()
    assert not rep.ok
    assert rep.verdict().startswith("FAIL: 1 difference from the sent-log (2 streams")
    assert rep.details() == [
        f"sent-log: a rank 1 incarnation 0 (epoch {E1}): topic has events at seq 0, which the "
        "sent-log does not list",
        f"a rank 0 epoch {E1}: lost seq 3: not in replay buffer",
    ]


# ------------------------------------------------------------------ CLI glue


def test_load_sent_log(tmp_path):
    path = tmp_path / "sent.jsonl"
    path.write_text(json.dumps(sent_entry("a", 0, 0, 0)) + "\n\n")
    assert load_sent_log(str(path)) == [sent_entry("a", 0, 0, 0)]
    path.write_text("{not json\n")
    with pytest.raises(ConfigError, match="line 1: not JSON"):
        load_sent_log(str(path))
    with pytest.raises(ConfigError, match="--expect-sent"):
        load_sent_log(str(tmp_path / "absent.jsonl"))


def test_load_sent_log_leaves_out_a_last_line_still_being_written(tmp_path):
    path = tmp_path / "sent.jsonl"
    whole = json.dumps(sent_entry("a", 0, 0, 0))
    path.write_text(whole + "\n" + whole[: len(whole) // 2])
    assert load_sent_log(str(path)) == [sent_entry("a", 0, 0, 0)]
    path.write_text(whole + "\n" + whole)  # complete, only the newline missing
    assert load_sent_log(str(path)) == [sent_entry("a", 0, 0, 0)] * 2
    path.write_text(whole[:10] + "\n" + whole + "\n")  # a broken line in the middle
    with pytest.raises(ConfigError, match="line 1: not JSON"):
        load_sent_log(str(path))


# ------------------------------------------------------------------ against a real broker


def test_check_topic_finds_holes_and_undecodable_records(kafka_bootstrap, make_topic):
    topic = make_topic()
    recs = [r for r in scenario()[0] if r.envelope.seq != 1 or r.envelope.epoch != E1]
    produce(kafka_bootstrap, topic, recs, garbage=1)
    seen: list[tuple[int, tuple[int, int | None]]] = []
    report = check_topic(kafka_bootstrap, topic, progress=lambda n, o: seen.append((n, o)))
    assert report.holes == [("a", 0, E1, 1, 1)] and report.undecodable == 1
    # The last call: every record read, and every offset (the garbage one too) of all.
    assert seen[-1] == (len(recs), (len(recs) + 1, len(recs) + 1))
    assert report.records == len(recs)


def test_records_of_a_moved_pods_old_epoch_after_its_new_one_are_checked_apart():
    # --repartition: the pod's new epoch (StreamStarted, new partition) is read before the
    # rest of its old epoch (old partition). The old records are no violation, and are still
    # accounted in their own epoch: a hole there is reported, the new epoch stays current.
    recs = [started("a", 0, E1)] + batches("a", 0, E1, [0])
    recs += [started("a", 0, E2)] + batches("a", 0, E2, [0, 1])
    recs += batches("a", 0, E1, [1, 3])  # late, with seq 2 missing
    recs += batches("a", 0, E2, [2])
    r = check(recs)
    assert r.violations == [], r.violations
    assert only(r).holes == [(E1, 2, 2)]
