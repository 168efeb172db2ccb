"""docker-compose.yml is valid and wired consistently (validated by docker-compose, no engine).

The checks read what ``docker-compose config`` prints (the resolved file, anchors merged) and
resolve each service's command and ``KVBRIDGE_*`` environment with the real ``kvbridge`` CLI:
the bridge's pod endpoints must be exactly the ports the simulated pods bind, its bootstrap
server the broker's listener for containers, every variable a setting the bridge reads.
Prometheus must scrape the bridge's metrics port, and Grafana's provisioned dashboard may only
query metrics the bridge exports (``bridge.ops.metrics.BridgeMetrics``).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from deploy_util import (
    ROOT,
    assert_env_reaches_config,
    check_settings,
    metric_names,
    unknown_metrics,
    walk,
)

from bridge.cli.commands import build_parser
from bridge.cli.run import resolve_run_config
from bridge.cli.simulate import build_specs
from bridge.ops.config import BridgeConfig
from bridge.simulator.pod import PodSpec

COMPOSE_FILE = ROOT / "docker-compose.yml"
TO_JSON = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"


def _yaml_to_data(text: str, compose: str) -> Any:
    """Parse YAML with PyYAML: ours if installed, else the interpreter docker-compose runs on
    (Debian's docker-compose 1.x is a Python program that depends on PyYAML)."""
    try:
        import yaml
    except ImportError:
        pass
    else:
        return yaml.safe_load(text)
    first = Path(compose).read_bytes()[:200].split(b"\n", 1)[0]
    assert first.startswith(b"#!"), f"{compose} is not a Python script; install PyYAML to test"
    interpreter = shlex.split(first[2:].decode())
    out = subprocess.run([*interpreter, "-c", TO_JSON], input=text, capture_output=True, text=True)
    assert out.returncode == 0, f"cannot parse the compose config as YAML:\n{out.stderr}"
    return json.loads(out.stdout)


@cache
def compose_config() -> dict[str, Any]:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose is not installed (scripts/test.sh installs Debian's package)")
    result = subprocess.run(
        [compose, "-f", str(COMPOSE_FILE), "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"docker-compose config failed:\n{result.stderr}"
    return _yaml_to_data(result.stdout, compose)


def services() -> dict[str, dict[str, Any]]:
    return compose_config()["services"]


def argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def kvbridge_services() -> list[str]:
    """The services built from this repository's Dockerfile (entrypoint kvbridge)."""
    return [name for name, svc in services().items() if "build" in svc]


def parse(name: str) -> argparse.Namespace:
    """A service's command as the real ``kvbridge`` CLI (the image's entrypoint) reads it."""
    try:
        return build_parser().parse_args(argv(services()[name]))
    except SystemExit:
        pytest.fail(f"kvbridge rejects the command of service {name}: {argv(services()[name])}")


def sims() -> dict[str, PodSpec]:
    """Simulated pod services -> the one pod each binds (via the simulator's own port rules)."""
    found = {}
    for name in kvbridge_services():
        args = parse(name)
        if args.command == "simulate":
            specs = build_specs(args)
            assert len(specs) == 1, f"{name} must simulate exactly one pod"
            found[name] = specs[0]
    assert len(found) == 3, f"expected three simulated pods, found {sorted(found)}"
    return found


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def bridge() -> tuple[str, BridgeConfig]:
    """The bridge service and the configuration its command and environment resolve to."""
    found = {name: parse(name) for name in kvbridge_services()}
    runs = [name for name, args in found.items() if args.command == "run"]
    assert len(runs) == 1, f"expected one bridge service, found {runs}"
    env = environment(services()[runs[0]])
    return runs[0], resolve_run_config(found[runs[0]], environ=env)


def endpoint(url: str | None) -> tuple[str, int]:
    parts = urlsplit(url or "")
    assert parts.scheme == "tcp" and parts.hostname and parts.port, f"bad endpoint {url!r}"
    return parts.hostname, parts.port


def test_config_is_valid() -> None:
    assert set(services()) >= {"kafka", "bridge"}


def test_every_bridge_pod_points_at_the_ports_its_sim_binds() -> None:
    simulated = sims()
    for pod in bridge()[1].pods:
        pub_host, pub_port = endpoint(pod.pub)
        replay_host, replay_port = endpoint(pod.replay)
        assert pub_host == replay_host, pod
        assert pub_host in simulated, f"{pod.pub} names no simulated pod service"
        sim = simulated[pub_host]
        assert sim.host == "0.0.0.0", f"{pub_host} must bind all interfaces"
        assert (pub_port, replay_port) == (sim.pub_port, sim.replay_port), (pod, sim)
        assert (pod.name, pod.model, pod.dp_size) == (sim.name, sim.model, sim.dp_size)


def test_every_sim_is_covered_by_exactly_one_pod() -> None:
    hosts = Counter(endpoint(pod.pub)[0] for pod in bridge()[1].pods)
    assert hosts == Counter(set(sims())), hosts
    releases = sorted(str(sim.release) for sim in sims().values())
    assert releases == ["0.23.0", "0.33.0", "0.9.0"]


def kafka_listeners(env_value: str) -> dict[str, tuple[str, int]]:
    found = {}
    for listener in env_value.split(","):
        name, _, address = listener.partition("://")
        host, _, port = address.rpartition(":")
        found[name] = (host, int(port))
    return found


def test_bridge_bootstraps_from_the_internal_listener() -> None:
    kafka = services()["kafka"]
    env = kafka["environment"]
    advertised = kafka_listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    bound = kafka_listeners(env["KAFKA_LISTENERS"])
    internal = [n for n, (host, _) in advertised.items() if host in ("kafka", kafka["hostname"])]
    assert len(internal) == 1, advertised
    host, port = advertised[internal[0]]
    assert bound[internal[0]][1] == port
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] == internal[0]
    name, config = bridge()
    assert config.bootstrap_servers == f"{host}:{port}"
    depends = services()[name]["depends_on"]
    assert depends["kafka"]["condition"] == "service_healthy"
    assert set(sims()) <= set(depends)


def test_kafka_image_is_a_pinned_4x_release_with_a_healthcheck() -> None:
    kafka = services()["kafka"]
    assert re.fullmatch(r"apache/kafka:4\.\d+\.\d+", kafka["image"]), kafka["image"]
    assert "kafka-broker-api-versions.sh" in " ".join(kafka["healthcheck"]["test"])


def test_services_run_the_repo_image_whose_entrypoint_is_kvbridge() -> None:
    assert set(kvbridge_services()) == {*sims(), bridge()[0]}
    for name in kvbridge_services():
        svc = services()[name]
        assert Path(svc["build"]["context"]).resolve() == ROOT, name
        assert svc["build"].get("dockerfile", "Dockerfile") == "Dockerfile", name
        assert "entrypoint" not in svc, f"{name} overrides the image's entrypoint"
    entrypoints = [
        line.split(None, 1)[1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.upper().startswith("ENTRYPOINT")
    ]
    assert entrypoints, "Dockerfile has no ENTRYPOINT"
    assert json.loads(entrypoints[-1]) == ["kvbridge"]


# -- configuration by environment -------------------------------------------------------------


def test_bridge_env_names_are_settings_kvbridge_run_reads() -> None:
    name, config = bridge()
    env = environment(services()[name])
    assert any(k.startswith("KVBRIDGE_") for k in env), "the bridge is configured by env"
    assert check_settings(env) == []
    assert_env_reaches_config(config, env)
    for sim in sims():
        assert check_settings(environment(services()[sim])) == [], sim


def url_of(value: str | None) -> tuple[str, int]:
    parts = urlsplit(value or "")
    assert parts.scheme == "http" and parts.hostname and parts.port, f"bad URL {value!r}"
    return parts.hostname, parts.port


def test_bridge_healthcheck_asks_readyz_on_its_metrics_port() -> None:
    name, config = bridge()
    svc = services()[name]
    command = " ".join(svc["healthcheck"]["test"])
    assert f"http://127.0.0.1:{config.metrics_port}/readyz" in command, command
    published = {int(p["target"]) for p in svc["ports"]}
    assert config.metrics_port in published


def test_schema_registry_stores_in_the_broker_and_the_bridge_registers_there() -> None:
    registry = services()["schema-registry"]
    assert re.fullmatch(r"confluentinc/cp-schema-registry:\d+\.\d+\.\d+", registry["image"])
    env = registry["environment"]
    kafka_env = services()["kafka"]["environment"]
    internal = kafka_listeners(kafka_env["KAFKA_ADVERTISED_LISTENERS"])["INTERNAL"]
    store = env["SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS"]
    assert store == f"PLAINTEXT://{internal[0]}:{internal[1]}"
    assert registry["depends_on"]["kafka"]["condition"] == "service_healthy"
    _, listen_port = url_of(env["SCHEMA_REGISTRY_LISTENERS"])
    name, config = bridge()
    assert url_of(config.schema_registry_url) == ("schema-registry", listen_port)
    assert services()[name]["depends_on"]["schema-registry"]["condition"] == "service_healthy"
    assert f"localhost:{listen_port}" in " ".join(registry["healthcheck"]["test"])


# -- Prometheus and Grafana ---------------------------------------------------------------------


def mounts(service: str) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts."""
    found = {}
    for volume in services()[service].get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        found[target] = Path(source)
    return found


def load_yaml(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def test_prometheus_scrapes_the_bridges_metrics_port() -> None:
    prom = services()["prometheus"]
    config_path = next(a.split("=", 1)[1] for a in argv(prom) if a.startswith("--config.file="))
    host_file = mounts("prometheus")[config_path]
    assert host_file.resolve() == (ROOT / "monitoring" / "prometheus.yml").resolve()
    config = load_yaml(host_file)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvbridge"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    name, bridge_config = bridge()
    assert targets == [f"{name}:{bridge_config.metrics_port}"]
    assert str(bridge_config.metrics_port) in services()[name]["expose"]


def grafana_files() -> tuple[dict[str, Any], dict[str, Any], Path]:
    """(datasources, dashboard providers, host folder of the dashboard JSON files)."""
    m = mounts("grafana")
    provisioning = m["/etc/grafana/provisioning"]
    assert provisioning.resolve() == (ROOT / "monitoring" / "grafana" / "provisioning").resolve()
    datasources = load_yaml(provisioning / "datasources" / "prometheus.yml")
    providers = load_yaml(provisioning / "dashboards" / "kvbridge.yml")
    (provider,) = providers["providers"]
    folder = provider["options"]["path"]
    assert folder in m, f"Grafana loads dashboards from {folder}, which nothing is mounted on"
    return datasources, providers, m[folder]


def dashboard() -> dict[str, Any]:
    _, _, folder = grafana_files()
    files = sorted(folder.glob("*.json"))
    assert [f.name for f in files] == ["kvbridge.json"]
    return json.loads(files[0].read_text())


def test_grafana_datasource_is_the_prometheus_service() -> None:
    """Panels use the dashboard's data source variable (so the JSON imports into any Grafana);
    in compose it defaults to the one provisioned data source, the Prometheus service."""
    datasources, _, _ = grafana_files()
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    published = {int(p["target"]) for p in services()["prometheus"]["ports"]}
    assert url_of(ds["url"]) in {("prometheus", port) for port in published}
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [n for n in walk(board) if "targets" in n]
    assert len(panels) >= 15
    for node in walk(board):
        source = node.get("datasource")
        if isinstance(source, dict):
            assert source == {"type": "prometheus", "uid": "${datasource}"}, node.get("title")
    for panel in panels:
        assert panel.get("datasource"), f"panel {panel['title']} has no data source"


def queries(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for node in walk(board) for t in node.get("targets", []) if "expr" in t]
    exprs += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_queries_only_metrics_the_bridge_exports() -> None:
    board = dashboard()
    assert board["uid"] == "kvbridge"
    exprs = queries(board)
    assert len(exprs) >= 20
    used = set().union(*(metric_names(e) for e in exprs))
    assert unknown_metrics(used) == []
    # The main metrics each have a panel; the lag's quantiles come from its histogram buckets.
    for name in (
        "kvbridge_events_in_total",
        "kvbridge_events_out_total",
        "kvbridge_records_out_total",
        "kvbridge_batches_in_total",
        "kvbridge_gaps_total",
        "kvbridge_replays_total",
        "kvbridge_batches_lost_total",
        "kvbridge_decode_errors_total",
        "kvbridge_produce_errors_total",
        "kvbridge_producer_queue",
        "kvbridge_e2e_lag_seconds_bucket",
        "kvbridge_connected",
        "kvbridge_seconds_since_last_event",
    ):
        assert name in used, f"no panel shows {name}"
    assert any(
        e.startswith("histogram_quantile(0.99,") and "kvbridge_e2e_lag_seconds_bucket" in e
        for e in exprs
    )
    by_outcome = [e for e in exprs if "kvbridge_replays_total" in e]
    assert any("by (outcome)" in e for e in by_outcome), by_outcome


def test_the_metric_check_catches_a_wrong_name() -> None:
    """Counters are exposed with _total: the bare name, or a made-up one, is reported."""
    assert unknown_metrics({"kvbridge_gaps_total", "kvbridge_e2e_lag_seconds_bucket"}) == []
    assert unknown_metrics({"kvbridge_gaps", "kvbridge_lag_seconds_bucket"}) == [
        "kvbridge_gaps",
        "kvbridge_lag_seconds_bucket",
    ]


def test_every_service_image_is_pinned() -> None:
    for name, svc in services().items():
        if "build" in svc:
            continue
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin {image}"
