"""``--listen-discover``: pods that connect to the bridge's SUB, followed from their topic frame.

The topic parser and the decision logic are pure and tested directly; the rest runs simulated
vLLM pods that connect their PUB to the bridge's listen socket (llm-d's layout), the bridge
in-process and the session's real Kafka broker, with no ``--pod`` configuration at all.
Pod ids are loopback addresses (127.0.0.2, ...) as llm-d's are pod IPs, so one replay template
``tcp://{pod}:PORT`` reaches every pod's own replay ROUTER.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from bridge_util import metric, read_all, running_bridge
from e2e_util import free_port_block, wait_for

from bridge.cli.commands import build_parser
from bridge.cli.run import resolve_run_config
from bridge.consume.checker import check_topic
from bridge.consume.sentlog import compare_with_sent
from bridge.ingest.listentopics import (
    Follow,
    ListenTopic,
    NotOwned,
    Refuse,
    check_replay_template,
    decide,
    parse_topic,
    replay_endpoint,
)
from bridge.log.markers import EventsLost
from bridge.ops.config import ConfigError, PodConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet

# -- the topic parser (pure) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        (b"kv@pod-a@llama", ListenTopic("pod-a", "llama")),
        (
            b"kv@10.0.0.5@meta-llama/Llama-3.1-8B",
            ListenTopic("10.0.0.5", "meta-llama/Llama-3.1-8B"),
        ),
        # split at the first two '@' only: the model keeps the rest
        (b"kv@10.0.0.5@org/model@v2", ListenTopic("10.0.0.5", "org/model@v2")),
        (b"kv@fd00::1a@m", ListenTopic("fd00::1a", "m")),
        ("kv@pod-ü@modèle".encode(), ListenTopic("pod-ü", "modèle")),
    ],
)
def test_topics_of_llm_d_shape_parse(topic: bytes, expected: ListenTopic) -> None:
    assert parse_topic(topic) == expected


@pytest.mark.parametrize(
    "topic",
    [
        b"",
        b"kv-events",
        b"kv@pod-a",  # no model
        b"kv@@llama",  # empty pod
        b"kv@pod-a@",  # empty model
        b"KV@pod-a@llama",  # the prefix is exact
        b"xkv@pod-a@llama",
        b"kv@pod a@llama",  # whitespace
        b"kv@pod-a@lla\nma",
        b"kv@pod\x00@llama",
        b"kv@\xff\xfe@llama",  # not UTF-8
        b"kv@" + b"p" * 254 + b"@llama",  # longer than a DNS name
    ],
)
def test_other_topics_do_not_parse(topic: bytes) -> None:
    assert parse_topic(topic) is None


def test_replay_template_gives_each_pod_its_endpoint() -> None:
    assert replay_endpoint("tcp://{pod}:5558", "10.0.0.5") == "tcp://10.0.0.5:5558"
    assert replay_endpoint("tcp://{pod}:5558", "fd00::1a") == "tcp://[fd00::1a]:5558"
    assert replay_endpoint("tcp://[{pod}]:5558", "fd00::1a") == "tcp://[fd00::1a]:5558"
    assert (
        replay_endpoint("tcp://{pod}.vllm.ns.svc:5558", "pod-a") == "tcp://pod-a.vllm.ns.svc:5558"
    )
    assert replay_endpoint(None, "10.0.0.5") is None
    # a pod id that is no host name goes without replay rather than into an endpoint
    assert replay_endpoint("tcp://{pod}:5558", "a/b") is None
    assert replay_endpoint("tcp://{pod}:5558", "pod-ü") is None


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("tcp://10.0.0.5:5558", "{pod} placeholder"),
        ("ipc:///tmp/{pod}", "tcp://"),
        ("tcp://{pod}", "tcp://{pod}:PORT"),
        ("tcp://{pod}:{port}", "tcp://{pod}:PORT"),
        ("tcp://{pod}-{model}:5558", "only placeholder"),
    ],
)
def test_bad_replay_templates_are_refused(template: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"listen_replay=.*" + says.replace("{", r"\{")):
        check_replay_template(template)


# -- the decision (pure) ------------------------------------------------------------------------


def _decide(topic: bytes, rank: int = 0, followed=None, discovered=None, owns=True, cap=10):
    parsed = parse_topic(topic)
    return decide(
        topic,
        rank,
        followed or {},
        discovered or set(),
        None if parsed is None else owns,
        cap,
        "tcp://{pod}:5558",
    )


def test_a_new_pod_is_followed_with_the_rank_of_its_listener() -> None:
    d = _decide(b"kv@10.0.0.5@llama", rank=1)
    assert d == Follow(
        PodConfig("10.0.0.5", "llama", None, "tcp://10.0.0.5:5558", 2, topic="kv@10.0.0.5@llama")
    )
    assert d.pod.replay_endpoint(1) == "tcp://10.0.0.5:5559"  # rank r: port + r


def test_a_known_pod_seen_on_a_higher_rank_grows() -> None:
    old = PodConfig("p", "m", None, "tcp://p:5558", 1, topic="kv@p@m")
    d = _decide(b"kv@p@m", rank=2, followed={"p": old}, discovered={"p"})
    assert d == Follow(PodConfig("p", "m", None, "tcp://p:5558", 3, topic="kv@p@m"))


def test_refusals() -> None:
    assert _decide(b"garbage") == Refuse("unknown_topic", _decide(b"garbage").why)
    full = {f"p{i}" for i in range(3)}
    followed = {n: PodConfig(n, "m", None, topic=f"kv@{n}@m") for n in full}
    d = _decide(b"kv@new@m", followed=followed, discovered=full, cap=3)
    assert isinstance(d, Refuse) and d.kind == "too_many_pods" and "(3)" in d.why
    # a configured pod's name is not taken over by a topic naming it
    configured = {"pod-a": PodConfig("pod-a", "m", "tcp://h:5557")}
    assert _decide(b"kv@pod-a@m", followed=configured).kind == "name_taken"
    # nor is a discovered pod's model changed by another topic
    d = _decide(b"kv@p0@other", rank=1, followed=followed, discovered=full)
    assert isinstance(d, Refuse) and d.kind == "name_taken"
    assert _decide(b"kv@elsewhere@m", owns=False) == NotOwned("elsewhere")
    # the cap counts discovered pods only, and a known pod's new rank is not a new pod
    d = _decide(b"kv@p0@m", rank=1, followed=followed, discovered=full, cap=3)
    assert isinstance(d, Follow) and d.pod.dp_size == 2


# -- settings -----------------------------------------------------------------------------------


def _resolve(argv: list[str], env: dict[str, str] | None = None):
    sources: dict[str, str] = {}
    args = build_parser().parse_args(["run", *argv])
    return resolve_run_config(args, environ=env or {}, sources=sources), sources


def test_settings_from_flags_and_env() -> None:
    cfg, sources = _resolve(
        ["--listen", "tcp://*:5557", "--listen-replay", "tcp://{pod}:5558"],
        {"KVBRIDGE_LISTEN_DISCOVER": "true", "KVBRIDGE_LISTEN_MAX_PODS": "50"},
    )
    assert cfg.listen_discover and cfg.listen_max_pods == 50 and cfg.listen_ranks == 1
    assert cfg.listen_replay == "tcp://{pod}:5558"
    assert sources["listen_discover"] == "env KVBRIDGE_LISTEN_DISCOVER"
    assert sources["listen_replay"] == "flag" and sources["listen_ranks"] == "default"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--listen-discover"], "needs a listen socket"),
        (["--listen", "tcp://*:5557", "--listen-discover", "--shard-count", "2"], "shard_count"),
        (["--listen", "tcp://*:5557", "--listen-max-pods", "0"], "listen_max_pods"),
        (["--listen", "tcp://*:5557", "--listen-ranks", "0"], "listen_ranks"),
        (["--listen", "tcp://*:5557", "--listen-replay", "tcp://h:5558"], "{pod}"),
    ],
)
def test_bad_settings_are_refused(argv: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("{", r"\{")):
        _resolve(argv)


# -- end to end: real ZeroMQ, the real broker ---------------------------------------------------


def _listen_pods(listen: str, replay_port: int, specs: list[tuple[str, str, int]], **kw):
    """Pods named by loopback addresses (llm-d: pod IPs), each binding its replay ROUTER on
    ``replay_port`` (+ rank) of its own address and connecting its PUB to ``listen``."""
    return [
        PodSpec(
            name=ip,
            model=model,
            release="0.33.0",
            host=ip,
            pub_port=replay_port - dp,  # unused (the PUB connects); replay_port = pub_port + dp
            replay_port=replay_port,
            dp_size=dp,
            topic=f"kv@{ip}@{model}",
            connect_pub=listen,
            seed=i,
            **kw,
        )
        for i, (ip, model, dp) in enumerate(specs)
    ]


def _wait_complete(bootstrap: str, topic: str, fleet: SimulatedFleet) -> None:
    sent = fleet.sent()
    last: list[str] = []

    def agree() -> bool:
        last[:] = compare_with_sent(read_all(bootstrap, topic), sent)
        return not last

    try:
        wait_for(agree, 60, "the topic to hold what the pods published", interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last[:10]}") from None


pytestmark_kafka = pytest.mark.kafka


@pytestmark_kafka
def test_discovered_pods_reach_the_topic_complete(kafka_bootstrap, make_topic):
    """Three pods (one with DP=2) and no --pod: each is followed from its topic, live gaps are
    replayed through the template, every batch is in Kafka exactly once."""
    topic = make_topic(partitions=2)
    base = free_port_block(2)
    replay_port = free_port_block(2)
    listen = f"tcp://127.0.0.1:{base}"
    specs = _listen_pods(
        listen,
        replay_port,
        [("127.0.0.2", "llama", 1), ("127.0.0.3", "org/model@v2", 2), ("127.0.0.4", "llama", 1)],
        rate=100,
        batches=80,
        drop_rate=0.1,
    )
    with (
        SimulatedFleet(*specs, start=False) as fleet,
        running_bridge(
            kafka_bootstrap,
            topic,
            [],
            listen=listen,
            listen_discover=True,
            listen_replay=f"tcp://{{pod}}:{replay_port}",
            listen_ranks=2,
        ) as bridge,
    ):
        fleet.start()
        fleet.wait_done(timeout=30)
        _wait_complete(kafka_bootstrap, topic, fleet)
        assert metric(bridge, "kvbridge_listen_discovered_total", kind="pod") == 3
        assert metric(bridge, "kvbridge_listen_discovered_total", kind="rank") <= 1
        for kind in ("unknown_topic", "too_many_pods", "name_taken"):
            assert metric(bridge, "kvbridge_decode_errors_total", pod="listener", kind=kind) == 0
        # the DP=2 pod is one pod with two ranks, both on their own replay ports
        dp2 = bridge.pods["127.0.0.3"]
        assert (dp2.model, dp2.dp_size) == ("org/model@v2", 2)
        assert dp2.replay_endpoint(1) == f"tcp://127.0.0.3:{replay_port + 1}"
        ranks = sorted((s.info.pod, s.info.dp_rank) for s in bridge.streams)
        assert ranks == [("127.0.0.2", 0), ("127.0.0.3", 0), ("127.0.0.3", 1), ("127.0.0.4", 0)]
        assert metric(bridge, "kvbridge_gaps_total", pod="127.0.0.3") > 0  # drops recovered
    records = read_all(kafka_bootstrap, topic)
    assert {(r.envelope.pod, r.envelope.model) for r in records} == {
        ("127.0.0.2", "llama"),
        ("127.0.0.3", "org/model@v2"),
        ("127.0.0.4", "llama"),
    }
    report = check_topic(kafka_bootstrap, topic, sent=fleet.sent())
    assert report.ok and len(report.streams) == 4 and report.lost_batches == 0, report.details()


@pytestmark_kafka
def test_without_a_replay_template_gaps_become_events_lost(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=1)
    listen = f"tcp://127.0.0.1:{free_port_block(1)}"
    (spec,) = _listen_pods(
        listen, free_port_block(1), [("127.0.0.5", "llama", 1)], rate=100, batches=40
    )
    # Connected before the first batch, so the batch that makes the bridge discover the pod is
    # seq 0: it must be delivered (there is no replay to hide a dropped one).
    spec = replace(
        spec,
        drop_seqs=frozenset({20, 21}),
        replay=False,
        wait_for_subscriber=True,
        start_delay=0.3,
    )
    with (
        SimulatedFleet(spec, start=False) as fleet,
        running_bridge(kafka_bootstrap, topic, [], listen=listen, listen_discover=True) as bridge,
    ):
        fleet.start()
        fleet.wait_done(timeout=30)
        _wait_complete(kafka_bootstrap, topic, fleet)  # delivered, or covered by EventsLost
        assert bridge.pods["127.0.0.5"].replay is None
    records = read_all(kafka_bootstrap, topic)
    lost = [r.event for r in records if isinstance(r.event, EventsLost)]
    assert [(e.from_seq, e.to_seq, e.reason) for e in lost] == [(20, 21, "replay disabled")]
    first = next(r.envelope for r in records if r.envelope.index >= 0)
    assert first.seq == 0  # the message that triggered the discovery was not dropped


@pytestmark_kafka
def test_the_cap_on_discovered_pods_is_enforced(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=1)
    listen = f"tcp://127.0.0.1:{free_port_block(1)}"
    replay_port = free_port_block(1)
    first, second = _listen_pods(
        listen, replay_port, [("127.0.0.6", "llama", 1), ("127.0.0.7", "llama", 1)], rate=100
    )
    with (
        SimulatedFleet(replace(first, batches=30), start=False) as one,
        running_bridge(
            kafka_bootstrap,
            topic,
            [],
            listen=listen,
            listen_discover=True,
            listen_replay=f"tcp://{{pod}}:{replay_port}",
            listen_max_pods=1,
        ) as bridge,
    ):
        one.start()
        one.wait_done(timeout=30)
        _wait_complete(kafka_bootstrap, topic, one)
        with SimulatedFleet(second) as two:

            def refused() -> bool:
                return (
                    metric(
                        bridge,
                        "kvbridge_decode_errors_total",
                        pod="listener",
                        kind="too_many_pods",
                    )
                    >= 5
                )

            wait_for(refused, 30, "the second pod's messages to be refused")
            assert two.sent()  # it did publish
        assert list(bridge.pods) == ["127.0.0.6"]
        assert metric(bridge, "kvbridge_listen_discovered_total", kind="pod") == 1
    assert {r.envelope.pod for r in read_all(kafka_bootstrap, topic)} == {"127.0.0.6"}


@pytestmark_kafka
def test_a_restarted_bridge_resumes_discovered_pods_from_their_checkpoints(
    kafka_bootstrap, make_topic
):
    """The second bridge discovers the pod again and continues its stream (same epoch, the
    batches published while no bridge ran replayed through the template): no second
    StreamStarted, nothing lost."""
    topic = make_topic(partitions=1)
    listen = f"tcp://127.0.0.1:{free_port_block(1)}"
    replay_port = free_port_block(1)
    (spec,) = _listen_pods(listen, replay_port, [("127.0.0.8", "llama", 1)], rate=50, batches=150)
    settings = dict(
        listen=listen,
        listen_discover=True,
        listen_replay=f"tcp://{{pod}}:{replay_port}",
        checkpoint_interval=0.2,
    )
    with SimulatedFleet(spec, start=False) as fleet:
        with running_bridge(kafka_bootstrap, topic, [], **settings) as first:
            fleet.start()

            def some_checkpointed() -> bool:
                cp = first.committed.get(("127.0.0.8", 0))
                return cp is not None and cp.seq >= 30

            wait_for(some_checkpointed, 30, "a checkpoint past seq 30")
        assert not fleet.done  # still publishing while no bridge runs
        with running_bridge(kafka_bootstrap, topic, [], **settings) as second:
            fleet.wait_done(timeout=30)
            _wait_complete(kafka_bootstrap, topic, fleet)
            assert metric(second, "kvbridge_listen_discovered_total", kind="pod") == 1
    report = check_topic(kafka_bootstrap, topic, allow_duplicates=True, sent=fleet.sent())
    assert report.ok and report.lost_batches == 0, report.details()
    (stream,) = report.streams.values()
    assert stream.markers["StreamStarted"] == 1 and stream.epochs == 1, report.details()
