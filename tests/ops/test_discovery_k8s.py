"""Kubernetes discovery: the pure state machine, the watcher (official client) against recorded
API responses served over local HTTP, and end to end with a real bridge, broker and pods."""

from __future__ import annotations

import copy
import threading
from typing import Any
from urllib.parse import urlsplit

import pytest
from bridge_util import metric, read_all, running_bridge
from e2e_util import wait_for
from k8s_fake_api import END, FakeKubeAPI, load_podlist, load_watch_events, status

from bridge.log.markers import PodRemoved, StreamStarted
from bridge.ops.config import PodConfig
from bridge.ops.discovery.k8s import (
    Add,
    K8sSettings,
    NotFollowed,
    PodTracker,
    Relist,
    Remove,
    Skip,
    pod_config,
)
from bridge.ops.discovery.k8swatch import KubernetesDiscovery, default_namespace
from bridge.simulator.pod import PodSpec, SimulatedFleet

NS = "llm"
SETTINGS = K8sSettings(namespace=NS)
UID_A = "0f6c1d2e-8a4b-4b3c-9d5e-1a2b3c4d5e60"
UID_A2 = "7e3d9c1b-2f4a-4e6b-8c0d-9a8b7c6d5e41"


def make_pod(
    name: str = "p",
    uid: str = "u1",
    ip: str | None = "10.0.0.5",
    phase: str = "Running",
    model: str | None = "m",
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    rv: str = "1",
    deleting: bool = False,
) -> dict[str, Any]:
    lab = {"model.aibrix.ai/kv-events-enabled": "true", **(labels or {})}
    if model is not None:
        lab["model.aibrix.ai/name"] = model
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": uid,
        "resourceVersion": rv,
        "labels": lab,
        "annotations": dict(annotations or {}),
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T21:25:10Z"
    st: dict[str, Any] = {"phase": phase}
    if ip:
        st["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "status": st}


def ev(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


def adds(actions: list) -> list[PodConfig]:
    return [a.pod for a in actions if isinstance(a, Add)]


def removes(actions: list) -> list[str]:
    return [a.name for a in actions if isinstance(a, Remove)]


# -- the pure state machine ----------------------------------------------------------------------


def test_list_follows_running_pods_with_ip_and_model():
    t = PodTracker(SETTINGS)
    actions = t.on_list(load_podlist())
    added = {p.name: p for p in adds(actions)}
    assert set(added) == {"vllm-llama-0", "vllm-qwen-0"}
    llama = added["vllm-llama-0"]
    assert (llama.model, llama.pub, llama.replay, llama.dp_size, llama.uid) == (
        "llama-3-8b",
        "tcp://10.244.1.17:5557",
        "tcp://10.244.1.17:5558",
        1,
        UID_A,
    )
    qwen = added["vllm-qwen-0"]  # model from the annotation, ports and dp from annotations
    assert (qwen.model, qwen.pub, qwen.replay, qwen.dp_size) == (
        "qwen2.5-7b",
        "tcp://10.244.2.33:6557",
        "tcp://10.244.2.33:6567",
        2,
    )
    assert qwen.pub_endpoint(1) == "tcp://10.244.2.33:6558"
    skips = {a.name: a for a in actions if isinstance(a, Skip)}
    assert skips["vllm-llama-1"].bad is False and "Pending" in skips["vllm-llama-1"].reason
    assert (
        skips["vllm-llama-old"].bad is False
        and "deletionTimestamp" in skips["vllm-llama-old"].reason
    )
    assert skips["vllm-nomodel-0"].bad is True and "model" in skips["vllm-nomodel-0"].reason
    assert t.resource_version == "104263"
    assert set(t.active) == {"vllm-llama-0", "vllm-qwen-0"}


def test_recorded_watch_stream():
    t = PodTracker(SETTINGS)
    t.on_list(load_podlist())
    out = [t.on_event(e) for e in load_watch_events()]
    # 1: Pending pod became Running with an IP
    assert [p.name for p in adds(out[0])] == ["vllm-llama-1"]
    assert adds(out[0])[0].pub == "tcp://10.244.3.5:5557"
    # 2: a bookmark moves the resourceVersion only
    assert out[1] == []
    # 3: deletionTimestamp set: removed at once (vLLM is shutting down)
    assert removes(out[2]) == ["vllm-llama-0"]
    # 4: the DELETED that follows finds nothing left to remove
    assert removes(out[3]) == []
    # 5, 6: recreated under the same name: Pending, then Running with a new uid and IP
    assert adds(out[4]) == []
    (new,) = adds(out[5])
    assert (new.name, new.uid, new.pub) == ("vllm-llama-0", UID_A2, "tcp://10.244.1.52:5557")
    # 7: 410 Gone: relist, forget the resourceVersion
    assert out[6] == [Relist(out[6][0].reason, gone=True)]
    assert "too old resource version" in out[6][0].reason
    assert t.resource_version is None


def test_bookmark_moves_resource_version_only():
    t = PodTracker(SETTINGS)
    t.on_list({"metadata": {"resourceVersion": "5"}, "items": [make_pod()]})
    bookmark = ev("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "77"}})
    assert t.on_event(bookmark) == []
    assert t.resource_version == "77" and set(t.active) == {"p"}


def test_new_uid_under_the_same_name_is_a_new_incarnation():
    t = PodTracker(SETTINGS)
    t.on_event(ev("ADDED", make_pod(uid="u1")))
    actions = t.on_event(ev("MODIFIED", make_pod(uid="u2")))
    assert [type(a) for a in actions] == [Remove, Add]
    assert "u1 -> u2" in actions[0].reason and actions[1].pod.uid == "u2"


def test_deleted_of_an_older_incarnation_keeps_the_new_one():
    t = PodTracker(SETTINGS)
    t.on_event(ev("ADDED", make_pod(uid="u2")))
    assert t.on_event(ev("DELETED", make_pod(uid="u1"))) == []
    assert t.active["p"].uid == "u2"
    assert removes(t.on_event(ev("DELETED", make_pod(uid="u2")))) == ["p"]
    assert t.active == {}


def test_unchanged_pod_is_not_added_twice_and_changed_ports_readd():
    t = PodTracker(SETTINGS)
    assert len(adds(t.on_event(ev("ADDED", make_pod())))) == 1
    assert t.on_event(ev("MODIFIED", make_pod(rv="2"))) == []
    changed = make_pod(rv="3", annotations={"kvbridge.io/pub-port": "7000"})
    actions = t.on_event(ev("MODIFIED", changed))
    assert [type(a) for a in actions] == [Remove, Add]
    assert actions[0].reason == "endpoints changed"
    assert actions[1].pod.pub == "tcp://10.0.0.5:7000"


@pytest.mark.parametrize("phase", ["Succeeded", "Failed", "Unknown"])
def test_pod_leaving_running_is_removed(phase):
    t = PodTracker(SETTINGS)
    t.on_event(ev("ADDED", make_pod()))
    actions = t.on_event(ev("MODIFIED", make_pod(phase=phase)))
    assert removes(actions) == ["p"]
    assert phase in next(a.reason for a in actions if isinstance(a, Remove))


def test_running_without_ip_waits():
    t = PodTracker(SETTINGS)
    actions = t.on_event(ev("ADDED", make_pod(ip=None)))
    assert adds(actions) == [] and actions == [Skip("p", "Running but no pod IP yet", False)]
    assert len(adds(t.on_event(ev("MODIFIED", make_pod())))) == 1


def test_skip_reported_once_per_reason():
    t = PodTracker(SETTINGS)
    first = t.on_event(ev("ADDED", make_pod(model=None)))
    again = t.on_event(ev("MODIFIED", make_pod(model=None, rv="2")))
    assert len(first) == 1 and first[0].bad and again == []


def test_relist_reconciles():
    t = PodTracker(SETTINGS)
    t.on_list({"metadata": {"resourceVersion": "1"}, "items": [make_pod("a"), make_pod("b")]})
    actions = t.on_list(
        {
            "metadata": {"resourceVersion": "9"},
            "items": [make_pod("a"), make_pod("b", uid="u9"), make_pod("c")],
        }
    )
    assert [(type(a).__name__, getattr(a, "name", None) or a.pod.name) for a in actions] == [
        ("Remove", "b"),
        ("Add", "b"),
        ("Add", "c"),
    ]
    actions = t.on_list({"metadata": {"resourceVersion": "12"}, "items": [make_pod("c")]})
    assert sorted(removes(actions)) == ["a", "b"]
    assert all("relist" in a.reason for a in actions if isinstance(a, Remove))
    assert t.resource_version == "12"


@pytest.mark.parametrize(
    ("annotations", "needle"),
    [
        ({"kvbridge.io/pub-port": "abc"}, "kvbridge.io/pub-port"),
        ({"kvbridge.io/pub-port": "70000"}, "kvbridge.io/pub-port"),
        ({"kvbridge.io/replay-port": "-1"}, "kvbridge.io/replay-port"),
        ({"kvbridge.io/dp-size": "0"}, "kvbridge.io/dp-size"),
        ({"kvbridge.io/dp-size": "two"}, "kvbridge.io/dp-size"),
        ({"kvbridge.io/dp-size": "2"}, "overlap"),  # 5557+1 == 5558
        ({"kvbridge.io/pub-port": "65535", "kvbridge.io/dp-size": "2"}, "65535"),
    ],
)
def test_bad_annotations_are_reported_not_followed(annotations, needle):
    t = PodTracker(SETTINGS)
    actions = t.on_event(ev("ADDED", make_pod(annotations=annotations)))
    assert len(actions) == 1 and isinstance(actions[0], Skip)
    assert actions[0].bad and needle in actions[0].reason
    assert t.active == {}


def test_replay_port_none_and_dp_ports():
    p = pod_config(
        make_pod(annotations={"kvbridge.io/replay-port": "none", "kvbridge.io/dp-size": "4"}),
        SETTINGS,
    )
    assert p.replay is None and p.dp_size == 4 and p.pub_endpoint(3) == "tcp://10.0.0.5:5560"


def test_ipv6_pod_ip_is_bracketed():
    p = pod_config(
        make_pod(ip="fd00:10:244::1a", annotations={"kvbridge.io/dp-size": "1"}), SETTINGS
    )
    assert p.pub == "tcp://[fd00:10:244::1a]:5557" and p.replay == "tcp://[fd00:10:244::1a]:5558"


def test_model_label_setting_and_fallbacks():
    custom = K8sSettings(namespace=NS, model_label="example.com/model")
    pod = make_pod(model="from-aibrix-label", labels={"example.com/model": "custom"})
    assert pod_config(pod, custom).model == "custom"
    # label missing: kvbridge.io/model annotation, then an annotation of the label's key
    pod = make_pod(model=None, annotations={"kvbridge.io/model": "anno"})
    assert pod_config(pod, SETTINGS).model == "anno"
    pod = make_pod(model=None, annotations={"model.aibrix.ai/name": "same-key"})
    assert pod_config(pod, SETTINGS).model == "same-key"
    # the label wins over the annotation
    pod = make_pod(model="label", annotations={"kvbridge.io/model": "anno"})
    assert pod_config(pod, SETTINGS).model == "label"


def test_bad_pod_objects():
    with pytest.raises(NotFollowed) as e:
        pod_config({"status": {}}, SETTINGS)
    assert e.value.bad
    with pytest.raises(NotFollowed) as e:
        pod_config(make_pod(ip="not-an-ip"), SETTINGS)
    assert e.value.bad and "podIP" in e.value.reason


def test_malformed_and_unknown_events_relist():
    t = PodTracker(SETTINGS)
    t.on_event(ev("ADDED", make_pod()))
    assert isinstance(t.on_event("junk")[0], Relist)
    assert isinstance(t.on_event({"type": "ADDED"})[0], Relist)
    assert isinstance(t.on_event(ev("WEIRD", make_pod()))[0], Relist)
    err = t.on_event(ev("ERROR", status(500, "InternalError", "etcd is sad")))
    assert err == [Relist(err[0].reason, gone=False)] and "etcd is sad" in err[0].reason
    assert isinstance(t.on_list({"kind": "Status"})[0], Relist)
    assert set(t.active) == {"p"}  # nothing dropped on bad input


def test_shard_filter():
    t = PodTracker(SETTINGS, owns=lambda name: name.endswith("0"))
    actions = t.on_list(
        {"metadata": {"resourceVersion": "1"}, "items": [make_pod("a-0"), make_pod("a-1")]}
    )
    assert [p.name for p in adds(actions)] == ["a-0"] and set(t.active) == {"a-0"}
    assert t.on_event(ev("MODIFIED", make_pod("a-1", rv="2"))) == []


def test_default_namespace(tmp_path):
    f = tmp_path / "namespace"
    f.write_text("inference\n")
    assert default_namespace(str(f)) == "inference"
    assert default_namespace(str(tmp_path / "missing")) == "default"


# -- the watcher (official client) against recorded responses over local HTTP ---------------------


class RecordingBridge:
    """Records what discovery asks of the bridge."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, str | None]] = []
        self.pods: dict[str, PodConfig] = {}

    def add_pod(self, pod: PodConfig) -> bool:
        with self.lock:
            self.calls.append(("add", pod.name, pod.uid))
            self.pods[pod.name] = pod
        return True

    def remove_pod(self, name: str, reason: str) -> None:
        with self.lock:
            self.calls.append(("remove", name, reason))
            self.pods.pop(name, None)

    def followed(self) -> dict[str, str | None]:
        with self.lock:
            return {n: p.uid for n, p in self.pods.items()}


def watcher(api: FakeKubeAPI, bridge: Any, **kw: Any) -> KubernetesDiscovery:
    kw.setdefault("backoff_initial", 0.05)
    return KubernetesDiscovery(bridge, SETTINGS, api.core_api(), **kw)


def test_watcher_lists_watches_and_relists_on_410():
    events = load_watch_events()
    with FakeKubeAPI(NS, load_podlist()) as api:
        bridge = RecordingBridge()
        d = watcher(api, bridge)
        d.start()
        try:
            wait_for(d.synced.is_set, 10, "the first list")
            assert bridge.followed() == {
                "vllm-llama-0": UID_A,
                "vllm-qwen-0": api.pod_list["items"][2]["metadata"]["uid"],
            }
            assert api.last("list")["labelSelector"] == "model.aibrix.ai/kv-events-enabled=true"
            wait_for(lambda: api.count("watch") == 1, 10, "the watch")
            w = api.last("watch")
            assert w["resourceVersion"] == "104263" and w["allowWatchBookmarks"] == "true"
            api.push(*events[:6])  # everything but the 410
            wait_for(
                lambda: bridge.followed().get("vllm-llama-0") == UID_A2,
                10,
                "the recreated pod",
            )
            assert ("remove", "vllm-llama-0", "terminating (deletionTimestamp set)") in bridge.calls
            assert "vllm-llama-1" in bridge.followed()
            # The API server's state moves on; the watch expires: relist and reconcile.
            new_a = events[5]["object"]
            running_b = events[0]["object"]
            api.set_pods([new_a, running_b], "104600")
            api.push(events[6])
            wait_for(lambda: api.count("list") == 2, 10, "the relist after 410")
            wait_for(lambda: "vllm-qwen-0" not in bridge.followed(), 10, "qwen removed")
            wait_for(lambda: api.count("watch") == 2, 10, "the new watch")
            assert api.last("watch")["resourceVersion"] == "104600"
            assert bridge.followed() == {
                "vllm-llama-0": UID_A2,
                "vllm-llama-1": running_b["metadata"]["uid"],
            }
            assert ("remove", "vllm-qwen-0", "no longer listed (relist)") in bridge.calls
            assert d.stats["bad_pods"] == 1  # vllm-nomodel-0, reported once
            sample = d.metrics.registry.get_sample_value
            assert sample("kvbridge_discovery_skipped_total", {"source": "kubernetes"}) == 1
            assert sample("kvbridge_discovery_pods", {"source": "kubernetes"}) == 2
        finally:
            d.stop()
            d.join(10)
        assert not d.is_alive()


def test_watch_end_resumes_without_relist_and_http_410_relists():
    with FakeKubeAPI(NS, load_podlist()) as api:
        bridge = RecordingBridge()
        d = watcher(api, bridge)
        d.start()
        try:
            wait_for(lambda: api.count("watch") == 1, 10, "the watch")
            api.push(ev("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "200000"}}))
            api.push(END)  # the watch's timeout passed: the server ends the stream
            wait_for(lambda: api.count("watch") == 2, 10, "the resumed watch")
            assert api.last("watch")["resourceVersion"] == "200000"
            assert api.count("list") == 1
            # The next watch is refused with HTTP 410 (not an event): relist.
            api.fail_next.append(("watch", 410, status(410, "Expired", "too old")))
            api.push(END)
            wait_for(lambda: api.count("list") == 2, 10, "the relist after HTTP 410")
            wait_for(lambda: api.count("watch") == 4, 10, "the watch after the relist")
            assert api.last("watch")["resourceVersion"] == "104263"
        finally:
            d.stop()
            d.join(10)
        assert not d.is_alive()
        # Nothing changed on the server: the pods were added once, never removed.
        assert [c for c in bridge.calls if c[0] == "remove"] == []
        assert len([c for c in bridge.calls if c[0] == "add"]) == 2


def test_api_errors_are_retried():
    with FakeKubeAPI(NS, load_podlist()) as api:
        api.fail_next.append(("list", 500, status(500, "InternalError", "etcd timeout")))
        api.fail_next.append(("list", 403, status(403, "Forbidden", "pods is forbidden")))
        api.fail_next.append(("list", 200, {"kind": "Status", "metadata": {}}))  # not a PodList
        bridge = RecordingBridge()
        d = watcher(api, bridge)
        d.start()
        try:
            wait_for(d.synced.is_set, 10, "a list that succeeds")
            assert api.count("list") == 4 and d.stats["errors"] == 3
            assert set(bridge.followed()) == {"vllm-llama-0", "vllm-qwen-0"}
            # A watch ERROR other than 410 relists after a backoff.
            wait_for(lambda: api.count("watch") == 1, 10, "the watch")
            api.push(ev("ERROR", status(500, "InternalError", "watch broke")))
            wait_for(lambda: api.count("list") == 5, 10, "the relist")
        finally:
            d.stop()
            d.join(10)
        assert not d.is_alive()


def test_a_bridge_error_does_not_stop_discovery():
    class Flaky(RecordingBridge):
        def add_pod(self, pod: PodConfig) -> bool:
            if pod.name == "vllm-llama-0":
                raise RuntimeError("boom")
            return super().add_pod(pod)

    with FakeKubeAPI(NS, load_podlist()) as api:
        bridge = Flaky()
        d = watcher(api, bridge)
        d.start()
        try:
            wait_for(d.synced.is_set, 10, "the list")
            assert set(bridge.followed()) == {"vllm-qwen-0"} and d.stats["apply_errors"] == 1
            api.push(load_watch_events()[0])
            wait_for(lambda: "vllm-llama-1" in bridge.followed(), 10, "the next pod")
        finally:
            d.stop()
            d.join(10)


def test_stop_interrupts_a_blocked_watch():
    with FakeKubeAPI(NS, load_podlist()) as api:
        d = watcher(api, RecordingBridge(), watch_timeout=3600)
        d.start()
        wait_for(lambda: api.count("watch") == 1, 10, "the watch")
        d.stop()
        d.join(10)
        assert not d.is_alive()


# -- end to end: the watcher drives a real bridge ------------------------------------------------


def sim_pod_object(template: dict[str, Any], name: str, uid: str, sim: Any, rv: str) -> dict:
    """A recorded pod object turned into one of the simulated pods (its IP and ports)."""
    obj = copy.deepcopy(template)
    meta = obj["metadata"]
    meta.update(name=name, uid=uid, resourceVersion=rv)
    meta["annotations"]["kvbridge.io/pub-port"] = str(urlsplit(sim.pub).port)
    meta["annotations"]["kvbridge.io/replay-port"] = str(urlsplit(sim.replay).port)
    obj["status"]["podIP"] = "127.0.0.1"
    obj["status"]["podIPs"] = [{"ip": "127.0.0.1"}]
    return obj


@pytest.mark.kafka
def test_discovered_pods_reach_kafka_and_removals_write_markers(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=2)
    template = load_podlist()["items"][0]  # vllm-llama-0, Running
    specs = [PodSpec(name=f"sim-{i}", rate=100, batches=0, seed=i) for i in range(2)]
    with SimulatedFleet(*specs) as fleet, running_bridge(kafka_bootstrap, topic, []) as bridge:
        a, b = (
            sim_pod_object(template, f"vllm-{i}", f"uid-{i}-1", p, "10")
            for i, p in enumerate(fleet.pods)
        )
        pending = copy.deepcopy(template)
        pending["metadata"].update(name="vllm-pending", uid="uid-p", resourceVersion="11")
        pending["status"] = {"phase": "Pending"}
        pod_list = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "12"}}
        with FakeKubeAPI(NS, {**pod_list, "items": [a, b, pending]}) as api:
            d = KubernetesDiscovery(bridge, SETTINGS, api.core_api(), backoff_initial=0.05)
            d.start()
            try:

                def pods_in_topic() -> set[str]:
                    recs = read_all(kafka_bootstrap, topic)
                    return {r.envelope.pod for r in recs if r.envelope.index >= 0}

                wait_for(lambda: pods_in_topic() == {"vllm-0", "vllm-1"}, 30, "events of both pods")
                wait_for(lambda: api.count("watch") >= 1, 10, "the watch")
                # vllm-0 is deleted, then recreated under the same name with a new uid; the
                # simulated engine keeps its seq running, yet this is a new incarnation.
                deleted = copy.deepcopy(a)
                deleted["metadata"]["resourceVersion"] = "20"
                deleted["metadata"]["deletionTimestamp"] = "2026-12-02T22:00:00Z"
                api.push(ev("DELETED", deleted))

                def markers(kind: type, pod: str) -> list:
                    recs = read_all(kafka_bootstrap, topic)
                    return [r for r in recs if isinstance(r.event, kind) and r.envelope.pod == pod]

                wait_for(lambda: markers(PodRemoved, "vllm-0"), 30, "PodRemoved for vllm-0")
                (removed,) = markers(PodRemoved, "vllm-0")
                assert removed.event.reason == "pod deleted"
                first_start = markers(StreamStarted, "vllm-0")[0].envelope.epoch
                api.push(
                    ev("ADDED", sim_pod_object(template, "vllm-0", "uid-0-2", fleet.pods[0], "21"))
                )
                wait_for(
                    lambda: len(markers(StreamStarted, "vllm-0")) == 2, 30, "a new incarnation"
                )
                second = markers(StreamStarted, "vllm-0")[1]
                assert second.envelope.epoch > first_start >= removed.envelope.epoch
                # vllm-1 replaced without a DELETED seen (e.g. a missed event): new uid.
                api.push(
                    ev(
                        "MODIFIED",
                        sim_pod_object(template, "vllm-1", "uid-1-2", fleet.pods[1], "22"),
                    )
                )
                wait_for(lambda: len(markers(StreamStarted, "vllm-1")) == 2, 30, "vllm-1 renewed")
                (r1,) = markers(PodRemoved, "vllm-1")
                assert "uid-1-2" in r1.event.reason

                def events_after(pod: str, epoch: int) -> int:
                    recs = read_all(kafka_bootstrap, topic)
                    return sum(
                        1
                        for r in recs
                        if r.envelope.pod == pod
                        and r.envelope.epoch == epoch
                        and r.envelope.index >= 0
                    )

                wait_for(
                    lambda: events_after("vllm-0", second.envelope.epoch) > 5, 30, "new events"
                )
                assert "vllm-pending" not in pods_in_topic()
            finally:
                d.stop()
                d.join(10)
        changes = "kvbridge_discovery_changes_total"
        assert metric(bridge, changes, source="kubernetes", action="added") == 4
        assert metric(bridge, changes, source="kubernetes", action="removed") == 2
        assert metric(bridge, "kvbridge_discovery_pods", source="kubernetes") == 2
    records = read_all(kafka_bootstrap, topic)
    starts = [r for r in records if isinstance(r.event, StreamStarted)]
    assert sorted(r.envelope.pod for r in starts) == ["vllm-0", "vllm-0", "vllm-1", "vllm-1"]
    removed = [r.envelope.pod for r in records if isinstance(r.event, PodRemoved)]
    assert sorted(removed) == ["vllm-0", "vllm-1"]


def test_fixture_files_are_valid():
    pods = load_podlist()
    assert pods["kind"] == "PodList" and len(pods["items"]) == 5
    assert [e["type"] for e in load_watch_events()] == [
        "MODIFIED",
        "BOOKMARK",
        "MODIFIED",
        "DELETED",
        "ADDED",
        "MODIFIED",
        "ERROR",
    ]


# -- settings ------------------------------------------------------------------------------------


def run_config(argv: list[str], env: dict[str, str] | None = None):
    from bridge.cli.commands import build_parser
    from bridge.cli.run import resolve_run_config

    return resolve_run_config(build_parser().parse_args(["run", *argv]), environ=env or {})


def test_discovery_settings_defaults_flags_and_env():
    cfg = run_config([])
    assert cfg.discovery == "static" and cfg.k8s_namespace is None
    assert cfg.k8s_label_selector == "model.aibrix.ai/kv-events-enabled=true"
    assert cfg.k8s_model_label == "model.aibrix.ai/name"
    assert (cfg.dns_interval, cfg.dns_pub_port, cfg.dns_replay_port) == (10.0, 5557, 5558)
    cfg = run_config(
        ["--discovery", "kubernetes", "--k8s-namespace", "llm", "--k8s-model-label", "x/model"],
        {"KVBRIDGE_K8S_LABEL_SELECTOR": "app=vllm", "KVBRIDGE_K8S_NAMESPACE": "ignored"},
    )
    assert (cfg.discovery, cfg.k8s_namespace, cfg.k8s_label_selector, cfg.k8s_model_label) == (
        "kubernetes",
        "llm",
        "app=vllm",
        "x/model",
    )
    cfg = run_config(
        [],
        {
            "KVBRIDGE_DISCOVERY": "dns",
            "KVBRIDGE_DNS_NAME": "vllm.llm.svc",
            "KVBRIDGE_DNS_INTERVAL": "30s",
            "KVBRIDGE_DNS_REPLAY_PORT": "0",
        },
    )
    assert (cfg.discovery, cfg.dns_name, cfg.dns_interval, cfg.dns_replay_port) == (
        "dns",
        "vllm.llm.svc",
        30.0,
        0,
    )


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (
            ["--discovery", "consul"],
            {},
            "discovery='consul': accepted values are static, kubernetes, dns",
        ),
        ([], {"KVBRIDGE_DISCOVERY": "k8s"}, "accepted values are static, kubernetes, dns"),
        (["--discovery", "dns"], {}, "discovery=dns needs dns_name"),
        (["--discovery", "dns", "--dns-name", "x", "--dns-interval", "0"], {}, "dns_interval"),
        (["--dns-pub-port", "0"], {}, "dns_pub_port=0: accepted values are 1-65535"),
        (["--dns-replay-port", "70000"], {}, "dns_replay_port=70000"),
        (["--dns-replay-port", "5557"], {}, "must differ from dns_pub_port"),
        ([], {"KVBRIDGE_DNS_INTERVAL": "soon"}, "dns_interval"),
        (
            ["--discovery", "kubernetes", "--k8s-kubeconfig", "/nonexistent/kubeconfig"],
            {},
            "k8s_kubeconfig='/nonexistent/kubeconfig': no such file",
        ),
    ],
)
def test_discovery_settings_errors(argv, env, needle):
    from bridge.ops.config import ConfigError

    with pytest.raises(ConfigError) as e:
        run_config(argv, env)
    assert needle in str(e.value)


def test_kubeconfig_file_is_used(tmp_path):
    from bridge.ops.discovery.k8swatch import make_core_api

    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: local\n"
        "clusters: [{name: local, cluster: {server: 'http://127.0.0.1:6443'}}]\n"
        "contexts: [{name: local, context: {cluster: local, user: me, namespace: llm}}]\n"
        "users: [{name: me, user: {token: abc}}]\n"
    )
    api = make_core_api(str(kubeconfig))
    assert api.api_client.configuration.host == "http://127.0.0.1:6443"
    bad = tmp_path / "bad"
    bad.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    from bridge.ops.config import ConfigError

    with pytest.raises(ConfigError, match="k8s_kubeconfig"):
        make_core_api(str(bad))


@pytest.mark.kafka
def test_kvbridge_run_with_kubernetes_discovery(kafka_bootstrap, make_topic, tmp_path):
    """The command line: ``kvbridge run --discovery kubernetes`` with a kubeconfig pointing at
    the local API stand-in follows the listed pod and stops cleanly on SIGTERM."""
    from e2e_util import Proc

    topic = make_topic(partitions=1)
    template = load_podlist()["items"][0]
    with SimulatedFleet(PodSpec(name="sim", rate=100, batches=0, seed=5)) as fleet:
        obj = sim_pod_object(template, "vllm-cli-0", "uid-cli", fleet.pods[0], "5")
        pod_list = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "6"}}
        with FakeKubeAPI(NS, {**pod_list, "items": [obj]}) as api:
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(
                "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
                f"clusters: [{{name: t, cluster: {{server: '{api.host}'}}}}]\n"
                "contexts: [{name: t, context: {cluster: t, user: u}}]\n"
                "users: [{name: u, user: {token: t0ken}}]\n"
            )
            args = ["run", "--bootstrap-servers", kafka_bootstrap, "--topic", topic]
            args += ["--metrics-port", "0", "--discovery", "kubernetes"]
            args += ["--k8s-namespace", NS, "--k8s-kubeconfig", str(kubeconfig)]
            proc = Proc(args, tmp_path / "bridge.log")
            try:
                wait_for(
                    lambda: any(
                        r.envelope.pod == "vllm-cli-0" and r.envelope.index >= 0
                        for r in read_all(kafka_bootstrap, topic)
                    ),
                    60,
                    "events of the discovered pod",
                )
                assert api.count("watch") >= 1
            finally:
                code = proc.stop()
            output = (tmp_path / "bridge.log").read_text()
            assert code == 0, output
            assert "discovered pod vllm-cli-0 (uid uid-cli" in output


def test_no_kubernetes_configuration_is_a_clear_error(tmp_path, monkeypatch):
    from bridge.ops.config import ConfigError
    from bridge.ops.discovery.k8swatch import make_core_api

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a cluster
    with pytest.raises(ConfigError) as e:
        make_core_api(None)
    assert "--k8s-kubeconfig" in str(e.value) and "in-cluster" in str(e.value)
