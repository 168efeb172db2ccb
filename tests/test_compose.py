"""docker-compose.yml is valid and wired consistently (validated by docker-compose, no engine).

The checks read what ``docker-compose config`` prints (the resolved file, anchors merged) and
parse each service's command with the real ``kvbridge`` CLI: the bridge's ``--pod`` endpoints
must be exactly the ports the simulated pods bind, its bootstrap server the broker's listener
for containers.
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

from bridge.cli import build_parser, resolve_run_config
from bridge.config import BridgeConfig
from bridge.simulator.cli import build_specs
from bridge.simulator.pod import PodSpec

ROOT = Path(__file__).resolve().parent.parent
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


def bridge() -> tuple[str, BridgeConfig]:
    found = {name: parse(name) for name in kvbridge_services()}
    runs = [name for name, args in found.items() if args.command == "run"]
    assert len(runs) == 1, f"expected one bridge service, found {runs}"
    return runs[0], resolve_run_config(found[runs[0]], environ={})


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
