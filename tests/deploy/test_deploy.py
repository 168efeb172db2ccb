"""deploy/ (Kubernetes manifests) validates and is wired consistently, and the Dockerfile's
HEALTHCHECK and the manifests' probes answer on a real running bridge.

Schemas: ``kubernetes-validate`` bundles the Kubernetes OpenAPI schemas (as JSON Schema), so
every manifest is validated offline, strictly (unknown fields are errors), against the oldest
release the manifests need (1.28, for the ``apps.kubernetes.io/pod-index`` label) and the
newest the package knows. The ServiceMonitor is a Prometheus Operator CRD with no bundled
schema: its fields are checked here by hand.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_util import (
    ROOT,
    assert_env_reaches_config,
    check_settings,
    metric_names,
    resolve,
    walk,
)
from e2e_util import Proc, free_port_block, metric_totals, read_json, wait_for

DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ("1.28", kubernetes_validate.latest_version())
SHARD_LABEL = "metadata.labels['apps.kubernetes.io/pod-index']"
# Exposed by any bridge that has delivered events (labelled counters appear once touched).
LIVE_METRICS = (
    "kvbridge_batches_in_total",
    "kvbridge_events_in_total",
    "kvbridge_events_out_total",
    "kvbridge_records_out_total",
    "kvbridge_markers_total",
    "kvbridge_producer_queue",
    "kvbridge_last_seq",
    "kvbridge_connected",
    "kvbridge_seconds_since_last_event",
    "kvbridge_e2e_lag_seconds_bucket",
    "kvbridge_e2e_lag_seconds_sum",
    "kvbridge_e2e_lag_seconds_count",
)


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def resources() -> list[dict[str, Any]]:
    """Every object ``kubectl apply -k deploy/`` creates."""
    return [d for name in kustomization()["resources"] for d in docs(DEPLOY / name)]


def one(kind: str) -> dict[str, Any]:
    found = [d for d in resources() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container() -> dict[str, Any]:
    containers = one("StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict[str, Any], **fields: str) -> dict[str, str]:
    """The container's environment as a pod named ``fields`` would see it (fieldRefs filled)."""
    env = {}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"{var['name']}: no test value for fieldRef {path}"
            env[var["name"]] = fields[path]
    return env


def config_file(tmp_path: Path) -> tuple[list[str], dict[str, Any]]:
    """The container's argv with the ConfigMap's TOML written where it is mounted, and the
    TOML itself."""
    cm = one("ConfigMap")
    c = container()
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    volume = next(
        v
        for v in one("StatefulSet")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "config"
    )
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    argv = list(c["args"])
    path = argv[argv.index("--config") + 1]
    assert Path(path).parent == Path(mount["mountPath"]), (path, mount)
    text = cm["data"][Path(path).name]
    local = tmp_path / Path(path).name
    local.write_text(text)
    argv[argv.index("--config") + 1] = str(local)
    return argv, tomllib.loads(text)


def test_kustomization_lists_every_manifest_but_the_servicemonitor() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - {"servicemonitor.yaml"}
    kinds = sorted(d["kind"] for d in resources())
    assert kinds == [
        "ConfigMap",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]
    for d in resources():
        assert "namespace" not in d["metadata"], f"{d['kind']} is pinned to a namespace"
    images = {i["name"]: i for i in kustomization()["images"]}
    assert container()["image"].split(":")[0] in images


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    for d in resources():
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{d['kind']} {d['metadata']['name']} (Kubernetes {version}): {exc}")


def test_the_validator_rejects_a_broken_manifest() -> None:
    """The schema check can fail: a misspelt field and a wrong type are both caught."""
    sts = one("StatefulSet")
    typo = json.loads(json.dumps(sts))
    typo["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    wrong_type = json.loads(json.dumps(sts))
    wrong_type["spec"]["replicas"] = "two"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_statefulset_replicas_each_take_their_shard_from_the_pod_index() -> None:
    sts = one("StatefulSet")
    env = {v["name"]: v for v in container()["env"]}
    index = env["KVBRIDGE_SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == SHARD_LABEL
    assert int(env["KVBRIDGE_SHARD_COUNT"]["value"]) == sts["spec"]["replicas"] >= 2
    # docs/deploy.md patches the count by position: /spec/template/spec/containers/0/env/1
    assert container()["env"][1]["name"] == "KVBRIDGE_SHARD_COUNT"
    ns = env["KVBRIDGE_K8S_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert ns == "metadata.namespace"
    template_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert sts["spec"]["serviceName"] == one("Service")["metadata"]["name"]


@pytest.mark.parametrize("ordinal", [0, 1])
def test_each_replica_resolves_its_own_shard_and_the_kubernetes_discovery(
    tmp_path: Path, ordinal: int
) -> None:
    """The container's argv, env and ConfigMap TOML, read by the real ``kvbridge run`` CLI."""
    argv, toml = config_file(tmp_path)
    env = env_of(container(), **{SHARD_LABEL: str(ordinal), "metadata.namespace": "vllm"})
    assert check_settings(env, set(toml)) == []
    cfg = resolve(argv, env)
    assert_env_reaches_config(cfg, env)
    assert (cfg.shard_index, cfg.shard_count) == (ordinal, one("StatefulSet")["spec"]["replicas"])
    assert cfg.discovery == "kubernetes"
    assert cfg.k8s_namespace == "vllm"
    assert cfg.k8s_label_selector == "model.aibrix.ai/kv-events-enabled=true"
    assert cfg.bootstrap_servers == toml["bootstrap_servers"]


def test_a_setting_the_bridge_does_not_know_is_reported() -> None:
    assert check_settings({"KVBRIDGE_SHARD_INDEX": "0", "KVBRIDGE_SHARDS": "2"}) == [
        "env KVBRIDGE_SHARDS: kvbridge run has no setting 'shards'"
    ]
    assert check_settings({}, {"topic", "kafka", "bootstrap"}) == [
        "TOML key bootstrap: kvbridge run has no setting 'bootstrap'"
    ]


def test_probes_and_the_service_use_the_metrics_port(tmp_path: Path) -> None:
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    argv, _ = config_file(tmp_path)
    cfg = resolve(argv, env_of(c, **{SHARD_LABEL: "0", "metadata.namespace": "vllm"}))
    assert ports["metrics"] == cfg.metrics_port == 9400
    assert cfg.metrics_host == "0.0.0.0"  # probes and Prometheus reach it from outside the pod
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    svc = one("Service")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 9400, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    for label in ("app.kubernetes.io/name", "app.kubernetes.io/component"):
        assert svc["metadata"]["labels"][label] == pod_labels[label]


def test_servicemonitor_scrapes_the_services_metrics_port() -> None:
    (sm,) = docs(DEPLOY / "servicemonitor.yaml")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    assert "namespace" not in sm["metadata"]
    assert set(sm["spec"]) == {"selector", "endpoints"}
    svc = one("Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_rbac_grants_only_reading_pods_to_the_bridges_service_account() -> None:
    role, binding, sa = one("Role"), one("RoleBinding"), one("ServiceAccount")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"]}]
    pod = one("StatefulSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]


def dockerfile_user() -> str:
    users = [
        line.split(None, 1)[1].strip()
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.upper().startswith("USER ")
    ]
    assert users, "Dockerfile has no USER: the image would run as root"
    return users[-1]


def test_the_container_runs_as_non_root_on_a_read_only_filesystem() -> None:
    pod = one("StatefulSet")["spec"]["template"]["spec"]
    c = container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    uid, _, gid = dockerfile_user().partition(":")
    assert uid.isdigit() and int(uid) != 0, "USER must be numeric for runAsNonRoot to verify"
    assert (int(uid), int(gid)) == (
        pod["securityContext"]["runAsUser"],
        pod["securityContext"]["runAsGroup"],
    )
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp"}
    limits = c["resources"]["limits"]
    assert "memory" in limits and "memory" in c["resources"]["requests"]


def test_the_build_context_keeps_what_the_dockerfile_copies() -> None:
    """Each COPY source exists and no .dockerignore pattern drops it from the build context."""
    ignored = [
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [
        src.rstrip("/")
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
    ]
    assert {"pyproject.toml", "README.md", "bridge", "schemas"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        for pattern in ignored:
            assert not fnmatch.fnmatch(src, pattern), f".dockerignore {pattern!r} drops {src}"


def healthcheck_command() -> list[str]:
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    checks = [line for line in lines if line.startswith("HEALTHCHECK")]
    assert len(checks) == 1, checks
    cmd = json.loads(checks[0].split(" CMD ", 1)[1])
    assert cmd[0] == "python" and "/healthz" in cmd[-1], cmd
    return [sys.executable, *cmd[1:]]


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:  # not listening (yet)
        return 0


def test_healthcheck_and_probes_answer_on_a_running_bridge(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    """The Dockerfile's HEALTHCHECK command and the probe paths against ``kvbridge run``
    (configured by env, as in the image) following one simulated pod; the HEALTHCHECK fails
    once the bridge is gone."""
    topic = make_topic()
    endpoints = tmp_path / "endpoints.json"
    base = free_port_block(3)
    sim = Proc(
        f"simulate --pods 1 --name pod-h --base-port {base} --rate 50 "
        f"--endpoints-file {endpoints}".split(),
        tmp_path / "sim.log",
    )
    bridge = None
    check = healthcheck_command()
    try:
        (pod,) = wait_for(lambda: read_json(endpoints), 30, "simulator endpoints")
        metrics_port = base + 2
        env = {
            "KVBRIDGE_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "KVBRIDGE_TOPIC": topic,
            "KVBRIDGE_METRICS_PORT": str(metrics_port),
            "KVBRIDGE_PODS": f"name=pod-h,model={pod['model']},pub={pod['pub']},"
            f"replay={pod['replay']}",
        }
        bridge = Proc(["run"], tmp_path / "bridge.log", env=env)
        url = f"http://127.0.0.1:{metrics_port}"
        wait_for(lambda: status(url + "/readyz") == 200, 60, "the bridge to be ready")
        assert status(url + "/healthz") == 200
        wait_for(
            lambda: metric_totals(url + "/metrics").get("kvbridge_records_out_total", 0) > 10,
            60,
            "records acknowledged by Kafka",
        )

        def missing() -> list[str]:
            return sorted(set(LIVE_METRICS) - metric_totals(url + "/metrics").keys())

        try:
            wait_for(lambda: not missing(), 10, "every metric to be exposed")
        except AssertionError:
            pytest.fail(f"the running bridge does not expose {missing()}")
        # What the Grafana dashboard plots is what a running bridge exposes, under these names.
        board = json.loads((ROOT / "monitoring/grafana/dashboards/kvbridge.json").read_text())
        plotted = set().union(
            *(metric_names(t["expr"]) for n in walk(board) for t in n.get("targets", []))
        )
        assert set(LIVE_METRICS) <= plotted, set(LIVE_METRICS) - plotted
        done = subprocess.run(check, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    finally:
        if bridge is not None:
            code = bridge.stop()
            assert code == 0, bridge.output()
        sim.stop()
    done = subprocess.run(check, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0, "the HEALTHCHECK passes with no bridge running"
