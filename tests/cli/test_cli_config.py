"""Run settings: flags over env over file; errors name the setting and what is accepted."""

from __future__ import annotations

import json

import pytest

from bridge.cli.args import kafka_target
from bridge.cli.commands import build_parser, main
from bridge.cli.configcheck import check_kafka_properties
from bridge.cli.run import resolve_run_config
from bridge.ops.config import ConfigError, is_secret, parse_pod, shared_kafka_properties

POD = "name=a,model=m,pub=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558"


def resolve(argv, environ=None):
    return resolve_run_config(build_parser().parse_args(["run", *argv]), environ or {})


def test_precedence_flags_env_file(tmp_path):
    f = tmp_path / "kv.toml"
    f.write_text(
        'bootstrap_servers = "file:9092"\ntopic = "from-file"\nreplay_timeout = 7\n'
        '[[pods]]\nname = "f"\npub = "tcp://h:1"\n[kafka]\n"client.id" = "x"\n'
    )
    env = {"KVBRIDGE_TOPIC": "from-env", "KVBRIDGE_REPLAY_TIMEOUT": "5"}
    cfg = resolve(["--config", str(f), "--replay-timeout", "3"], env)
    assert cfg.bootstrap_servers == "file:9092"
    assert cfg.topic == "from-env"
    assert cfg.replay_timeout == 3.0
    assert [p.name for p in cfg.pods] == ["f"]
    assert cfg.kafka == {"client.id": "x"}
    cfg = resolve(["--config", str(f), "--pod", POD], {"KVBRIDGE_PODS": "name=e,pub=tcp://h:2"})
    assert [p.name for p in cfg.pods] == ["a"]
    cfg = resolve(
        ["--config", str(f)], {"KVBRIDGE_PODS": "name=e,pub=tcp://h:2;name=g,pub=tcp://h:4"}
    )
    assert [p.name for p in cfg.pods] == ["e", "g"]


def test_pod_spec_and_dp_ports():
    p = parse_pod(POD + ",dp=3")
    assert p.pub_endpoint(2) == "tcp://10.0.0.5:5559"
    assert p.replay_endpoint(2) == "tcp://10.0.0.5:5560"
    assert parse_pod("name=b,pub=tcp://[::1]:5557,dp=2").pub_endpoint(1) == "tcp://[::1]:5558"


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("name=a", "pub= is required"),
        ("name=a,pub=http://x:1", "ZeroMQ endpoint"),
        ("name=a,pub=tcp://x", "needs a port"),
        ("name=a,pub=tcp://x:1,dp=0", "dp='0' must be"),
        ("name=a,pub=tcp://x:1,colour=red", "unknown key"),
        ("name=a,pub", "not key=value"),
        ("name=a,pub=ipc:///tmp/x,dp=2", "data-parallel ranks > 0"),
        ("name=a,model=m,pub=tcp://x:1,name=b", "name= is given twice"),
        ("name=a,pub=tcp://x:1,pub=tcp://y:1", "pub= is given twice"),
        ("name=a,pub=tcp://x:1,dp=2,dp_size=3", "dp_size= is given twice"),
    ],
)
def test_bad_pod_specs_say_what_to_do(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_pod(spec)


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="KVBRIDGE_REPLAY_TIMEOUT"):
        resolve(["--pod", POD], {"KVBRIDGE_REPLAY_TIMEOUT": "soon"})


def test_cli_errors_exit_2_with_a_message(capsys, tmp_path):
    assert main(["run", "--metrics-port", "0"]) == 2
    assert "no pods to follow" in capsys.readouterr().err
    assert main(["run", "--pod", POD, "--pod", POD]) == 2
    assert "unique" in capsys.readouterr().err
    assert main(["run", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "name=NAME,model=MODEL,pub=tcp://HOST:5557" in out and "KVBRIDGE_" in out


# -- where each value came from, librdkafka properties from the environment ---------------------


def test_sources_and_kafka_properties_from_env(tmp_path):
    f = tmp_path / "kv.toml"
    f.write_text(
        'topic = "from-file"\nreplay_attempts = 4\n'
        '[kafka]\n"sasl.mechanism" = "SCRAM-SHA-256"\n"client.id" = "file"\n'
        '"enable.ssl.certificate.verification" = false\n'
    )
    env = {
        "KVBRIDGE_KAFKA_SASL_MECHANISM": "PLAIN",
        "KVBRIDGE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KVBRIDGE_KAFKA_CLIENT_ID": "env",
        "AIBRIX_ZMQ_POLL_TIMEOUT": "50ms",
    }
    sources: dict[str, str] = {}
    args = build_parser().parse_args(
        ["run", "--config", str(f), "--pod", POD, "--kafka-property", "client.id=flag"]
    )
    cfg = resolve_run_config(args, env, sources)
    assert cfg.kafka == {
        "sasl.mechanism": "PLAIN",
        "security.protocol": "SASL_SSL",
        "client.id": "flag",
        "enable.ssl.certificate.verification": "false",
    }
    assert sources["kafka.sasl.mechanism"] == "env KVBRIDGE_KAFKA_SASL_MECHANISM"
    assert sources["kafka.security.protocol"] == "env KVBRIDGE_KAFKA_SECURITY_PROTOCOL"
    assert sources["kafka.client.id"] == "flag"
    assert sources["kafka.enable.ssl.certificate.verification"] == f"file {f}"
    assert sources["topic"] == f"file {f}" and cfg.topic == "from-file"
    assert sources["replay_attempts"] == f"file {f}" and cfg.replay_attempts == 4
    assert sources["poll_timeout"] == "env AIBRIX_ZMQ_POLL_TIMEOUT" and cfg.poll_timeout == 0.05
    assert sources["bootstrap_servers"] == "default"
    assert sources["pods"] == "flag"


def test_config_file_from_env(tmp_path):
    f = tmp_path / "kv.toml"
    f.write_text('topic = "via-env-path"\n')
    cfg = resolve(["--pod", POD], {"KVBRIDGE_CONFIG": str(f)})
    assert cfg.topic == "via-env-path"


def test_unknown_env_variables_warn_but_service_links_do_not():
    notes: list[str] = []
    env = {
        "KVBRIDGE_TOPC": "typo",
        "KVBRIDGE_PORT": "tcp://10.0.0.1:9400",  # Kubernetes service links of a Service
        "KVBRIDGE_SERVICE_HOST": "10.0.0.1",  # named "kvbridge": not settings
        "KVBRIDGE_PORT_9400_TCP_ADDR": "10.0.0.1",
    }
    args = build_parser().parse_args(["run", "--pod", POD])
    resolve_run_config(args, env, notes=notes)
    assert notes == ["KVBRIDGE_TOPC is not a kvbridge setting and is ignored (a typo?)"]


def test_shared_kafka_properties_leave_out_producer_tuning():
    props = {
        "security.protocol": "SASL_SSL",
        "sasl.username": "u",
        "enable.ssl.certificate.verification": "false",
        "client.id": "c",
        "linger.ms": "10",
        "acks": "1",
        "transactional.id": "t",
    }
    assert shared_kafka_properties(props) == {
        "security.protocol": "SASL_SSL",
        "sasl.username": "u",
        "enable.ssl.certificate.verification": "false",
        "client.id": "c",
    }


def test_reader_commands_take_kafka_properties_from_env(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_KAFKA_SASL_MECHANISM", "PLAIN")
    args = build_parser().parse_args(["consume", "--kafka-property", "client.id=x"])
    _, _, props = kafka_target(args)
    assert props == {"sasl.mechanism": "PLAIN", "client.id": "x"}


# -- every invalid value fails at start, naming the setting and what is accepted ---------------

ENV_ERRORS = [
    ("BOOTSTRAP_SERVERS", "kafka:port", "bootstrap_servers", "HOST:PORT"),
    ("BOOTSTRAP_SERVERS", "a:9092,,b:9092", "bootstrap_servers", "HOST:PORT"),
    ("TOPIC", "kv events", "topic", "1-249 characters"),
    ("TOPIC_PARTITIONS", "0", "topic_partitions", ">= 1"),
    ("TOPIC_PARTITIONS", "many", "topic_partitions", "a whole number"),
    ("TOPIC_REPLICATION", "0", "topic_replication", "-1 (the broker's default)"),
    ("METRICS_PORT", "70000", "metrics_port", "0 to turn the endpoint off"),
    ("METRICS_PORT", "tcp://10.0.0.1:9400", "metrics_port", "a whole number"),
    ("METRICS_HOST", " ", "metrics_host", "an address to listen on"),
    ("FIRST_CONTACT", "sometimes", "first_contact", "replay, live"),
    ("REPLAY_TIMEOUT", "0", "replay_timeout", "a duration > 0"),
    ("REPLAY_TIMEOUT", "nan", "replay_timeout", "units (100ms, 5s, 1m30s)"),
    ("REPLAY_DEADLINE", "-1s", "replay_deadline", "a duration"),
    ("REPLAY_ATTEMPTS", "0", "replay_attempts", ">= 1"),
    ("MAX_REPLAYS", "-2", "max_replays", ">= 1"),
    ("MAX_SEQ_JUMP", "0", "max_seq_jump", ">= 1"),
    ("MAX_HELD", "1e4", "max_held", "a whole number"),
    ("RECONNECT_INITIAL", "0s", "reconnect_initial", "a duration > 0"),
    ("RECONNECT_MAX", "100ms", "reconnect_max", ">= reconnect_initial"),
    ("RECONNECT_FACTOR", "0.5", "reconnect_factor", ">= 1.0"),
    ("RECONNECT_FACTOR", "fast", "reconnect_factor", "a number"),
    ("SILENCE_TIMEOUT", "soon", "silence_timeout", "a duration"),
    ("IDLE_PROBE", "inf", "idle_probe", "a duration"),
    ("POLL_TIMEOUT", "0", "poll_timeout", "a duration > 0"),
    ("CHECKPOINT_TOPIC", "", "checkpoint_topic", "1-249 characters"),
    ("CHECKPOINT_TOPIC", "a/b", "checkpoint_topic", "1-249 characters"),
    ("CHECKPOINT_INTERVAL", "0", "checkpoint_interval", "a duration > 0"),
    ("EXACTLY_ONCE", "maybe", "exactly_once", "true or false"),
    ("TRANSACTIONAL_ID", " ", "transactional_id", "must not be empty"),
    ("COMMIT_INTERVAL", "0ms", "commit_interval", "a duration > 0"),
    ("COMMIT_MAX_EVENTS", "0", "commit_max_events", ">= 1"),
    ("SHUTDOWN_TIMEOUT", "0", "shutdown_timeout", "a duration > 0"),
    ("RCVHWM", "0", "rcvhwm", ">= 1"),
    ("LISTEN", "http://x:1", "listen", "ZeroMQ endpoint"),
    ("SHARD_INDEX", "2", "shard_index", "0..count-1"),
    ("PODS", "name=a,pub=tcp://x", "pod", "needs a port"),
]


@pytest.mark.parametrize(
    "var, value, setting, accepted", ENV_ERRORS, ids=[f"{e[0]}={e[1]!r}" for e in ENV_ERRORS]
)
def test_every_invalid_env_value_names_setting_and_accepted(var, value, setting, accepted):
    argv = [] if var == "PODS" else ["--pod", POD]  # --pod would win over KVBRIDGE_PODS
    with pytest.raises(ConfigError) as info:
        resolve(argv, {"KVBRIDGE_" + var: value})
    msg = str(info.value)
    assert setting in msg and accepted in msg, msg


FILE_ERRORS = [
    ('topic = ["a"]', "topic", "expected a string"),
    ("replay_attempts = 2.5", "replay_attempts", "a whole number"),
    ("replay_attempts = true", "replay_attempts", "a whole number"),
    ('exactly_once = "maybe"', "exactly_once", "true or false"),
    ("replay_timeout = false", "replay_timeout", "a duration"),
    ("replay_timout = 3", "replay_timout", "accepted: "),
    ('pods = "name=a"', "pods", "[[pods]] tables"),
    ('[kafka]\n"sasl" = { mechanism = "PLAIN" }', "[kafka]", "a table of librdkafka properties"),
    ("[[pods]]\nname = 'a'\npub = 'tcp://h:1'\ncolour = 'red'", "unknown key", "accepted"),
]


@pytest.mark.parametrize("text, setting, accepted", FILE_ERRORS)
def test_every_invalid_file_value_names_setting_and_accepted(tmp_path, text, setting, accepted):
    f = tmp_path / "kv.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        resolve(["--config", str(f)])
    msg = str(info.value)
    assert setting in msg and accepted in msg, msg
    assert "from file" in msg or "config file" in msg or "pod" in msg


def test_unknown_file_key_lists_accepted_settings(tmp_path):
    f = tmp_path / "kv.toml"
    f.write_text("replay_timout = 3\n")
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) replay_timout") as info:
        resolve(["--config", str(f), "--pod", POD])
    assert "replay_timeout" in str(info.value) and "topic_partitions" in str(info.value)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--topic-partitions", "0"], "topic_partitions=0 (from flag): must be"),
        (["--topic-replication", "-3"], "topic_replication=-3 (from flag)"),
        (["--replay-attempts", "0"], "replay_attempts=0 (from flag)"),
        (["--metrics-port", "-1"], "metrics_port=-1 (from flag)"),
        (["--max-held", "0"], "max_held=0 (from flag)"),
    ],
)
def test_invalid_flags_exit_2_naming_the_setting(capsys, flags, needle):
    assert main(["run", "--pod", POD, *flags]) == 2
    assert needle in capsys.readouterr().err


def test_malformed_flag_values_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "--pod", POD, "--replay-timeout", "soon"])
    assert info.value.code == 2
    assert "--replay-timeout" in capsys.readouterr().err


# -- librdkafka properties are checked at start (Kafka is not contacted) ------------------------

KAFKA_ERRORS = [
    (
        ["security.protocol=SASL_PLAINTEXT", "sasl.mechanism=NOPE"],
        "Unsupported SASL mechanism: NOPE",
        "sasl.mechanism (from flag)",
    ),
    (
        ["sasl.mechanizm=PLAIN"],
        'No such configuration property: "sasl.mechanizm"',
        "sasl.mechanizm",
    ),
    (
        ["security.protocol=SASL_SSL", "sasl.mechanism=PLAIN"],
        "sasl.username and sasl.password must be set",
        "sasl.mechanism",
    ),
    (["linger.ms=soon"], "Invalid value", "linger.ms (from flag)"),
]


@pytest.mark.parametrize("props, librdkafka_says, named", KAFKA_ERRORS)
def test_run_refuses_kafka_properties_librdkafka_refuses(capsys, props, librdkafka_says, named):
    argv = ["run", "--pod", POD, "--metrics-port", "0"]
    for p in props:
        argv += ["--kafka-property", p]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert librdkafka_says in err and named in err, err


def test_sasl_settings_from_env_reach_librdkafka(capsys, monkeypatch):
    """A misconfigured SASL mechanism given by environment fails `run` at start, named."""
    monkeypatch.setenv("KVBRIDGE_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("KVBRIDGE_KAFKA_SASL_MECHANISM", "SCRAM-SHA-999")
    monkeypatch.setenv("KVBRIDGE_KAFKA_SASL_USERNAME", "bridge")
    monkeypatch.setenv("KVBRIDGE_KAFKA_SASL_PASSWORD", "hunter2")
    assert main(["run", "--pod", POD, "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "SCRAM-SHA-999" in err and "env KVBRIDGE_KAFKA_SASL_MECHANISM" in err, err


def test_valid_sasl_settings_pass_the_check():
    props = {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "u",
        "sasl.password": "p",
    }
    assert check_kafka_properties(props) == []
    warnings = check_kafka_properties({"sasl.mechanism": "PLAIN"})
    assert any("security.protocol" in w for w in warnings), warnings


# -- kvbridge config check -------------------------------------------------------------------


def test_config_check_prints_sources_masks_secrets_and_reads_back(capsys, tmp_path, monkeypatch):
    f = tmp_path / "kv.toml"
    f.write_text(
        'topic = "from-file"\n[[pods]]\nname = "f"\nmodel = "m"\npub = "tcp://h:1"\n'
        '[kafka]\n"ssl.key.password" = "file-secret"\n'
    )
    monkeypatch.setenv("KVBRIDGE_REPLAY_ATTEMPTS", "5")
    monkeypatch.setenv("KVBRIDGE_KAFKA_SASL_PASSWORD", "hunter2")
    monkeypatch.setenv("KVBRIDGE_KAFKA_SASL_USERNAME", "bridge")
    argv = ["config", "check", "--config", str(f), "--max-replays", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "file-secret" not in out
    assert '"sasl.password" = "****"  # env KVBRIDGE_KAFKA_SASL_PASSWORD' in out
    assert '"ssl.key.password" = "****"  # file' in out
    assert '"sasl.username" = "bridge"' in out
    assert "max_replays = 3  # flag" in out
    assert "replay_attempts = 5  # env KVBRIDGE_REPLAY_ATTEMPTS" in out
    assert f'topic = "from-file"  # file {f}' in out
    assert 'bootstrap_servers = "localhost:9092"  # default' in out
    # The output is a config file: read back (without env or flags) it gives the same settings.
    back = tmp_path / "back.toml"
    back.write_text(out)
    monkeypatch.delenv("KVBRIDGE_REPLAY_ATTEMPTS")
    again = resolve(["--config", str(back)])
    first = resolve(["--config", str(f), "--max-replays", "3"], {"KVBRIDGE_REPLAY_ATTEMPTS": "5"})
    assert again.pods == first.pods and again.max_replays == 3 and again.replay_attempts == 5
    assert again.topic == first.topic and again.kafka["sasl.password"] == "****"


def test_config_check_json(capsys, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET", "s3cret")
    monkeypatch.setenv("KVBRIDGE_TOPC", "typo")
    assert main(["config", "check", "--pod", POD, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] is True
    s = doc["settings"]
    assert s["pods"] == {
        "value": [
            {
                "name": "a",
                "model": "m",
                "pub": POD.split("pub=")[1].split(",")[0],
                "replay": "tcp://10.0.0.5:5558",
            }
        ],
        "source": "flag",
    }
    assert s["kafka"]["sasl.oauthbearer.client.secret"] == {
        "value": "****",
        "source": "env KVBRIDGE_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET",
    }
    assert s["topic_partitions"] == {"value": 6, "source": "default"}
    assert s["topic_replication"] == {"value": -1, "source": "default"}
    assert any("KVBRIDGE_TOPC" in w for w in doc["warnings"])


def test_config_check_invalid_exits_2_with_the_message(capsys):
    assert main(["config", "check", "--pod", POD, "--reconnect-factor", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "reconnect_factor=0.5 (from flag): must be a number >= 1.0" in err
    assert main(["config", "check"]) == 2
    assert "no pods to follow" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, secret",
    [
        ("sasl.password", True),
        ("ssl.key.password", True),
        ("ssl.key.pem", True),
        ("sasl.oauthbearer.client.secret", True),
        ("sasl.jaas.config", True),
        ("ssl.keystore.password", True),
        ("sasl.oauthbearer.config", True),
        ("sasl.username", False),
        ("security.protocol", False),
        ("ssl.ca.location", False),
    ],
)
def test_secret_property_names(name, secret):
    assert is_secret(name) is secret


@pytest.mark.parametrize("command", [["run"], ["config", "check"]])
@pytest.mark.parametrize("key", ["pub", "replay"])
def test_a_bind_address_in_a_pod_spec_is_refused_saying_what_to_give(capsys, command, key):
    """vLLM's documented endpoint tcp://*:45999 is where vLLM binds, not where to connect."""
    spec = "name=a,model=m,pub=tcp://*:45999"
    if key == "replay":
        spec = "name=a,model=m,pub=tcp://10.0.0.5:5557,replay=tcp://*:45999"
    assert main([*command, "--metrics-port", "0", "--pod", spec]) == 2
    err = capsys.readouterr().err
    assert f"pod a {key}='tcp://*:45999' is a bind address" in err
    assert "e.g. tcp://10.0.0.5:45999" in err and "--listen tcp://*:45999" in err


@pytest.mark.timeout(120)
def test_a_bridge_whose_start_fails_closes_without_hanging(kafka_bootstrap, kafka_topic):
    """open() fails on a socket it made (connect refused by libzmq); close() still returns."""
    import zmq

    from bridge.ingest.runner import Bridge
    from bridge.ops.config import BridgeConfig, PodConfig

    pods = [PodConfig("a", "m", "tcp://*:45999", "tcp://127.0.0.1:45998")]
    bridge = Bridge(
        BridgeConfig(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, pods=pods, metrics_port=0
        )
    )
    try:
        bridge.open()
    except zmq.ZMQError:
        bridge.close()  # as `kvbridge run` does; before the fix: blocked for good in term()
    else:
        pytest.fail("open() connected to a bind address")
    assert bridge.ctx.closed


def test_config_check_warns_of_dp_port_collisions_and_a_missing_model(capsys):
    """README: keep the replay port >= PUB port + N; a pod without model= is 'unknown'."""
    ok = "name=a,model=m,pub=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5559,dp=2"
    clash = "name=b,model=m,pub=tcp://10.0.0.6:5557,replay=tcp://10.0.0.6:5558,dp=2"
    anon = "name=c,pub=tcp://10.0.0.7:5557"
    argv = ["config", "check", "--format", "json", "--metrics-port", "0"]
    assert main([*argv, "--pod", ok, "--pod", clash, "--pod", anon]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert warnings == [
        "pod b: with dp=2, rank 1's PUB port 5558 is rank 0's replay port (rank r uses port + r "
        "on both endpoints); keep the replay port >= PUB port + 2, e.g. "
        "replay=tcp://10.0.0.6:5559, and vLLM's replay_endpoint to match",
        "pod c: no model= given, so its records say model 'unknown'; add model=<the name vLLM "
        "serves>",
    ]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--workers", "2", "--listen-discover", "--listen", "tcp://*:5557"],
            "listen_discover with --workers 2: a vLLM pod connects its PUB to one address",
        ),
        (["--pod", POD, "--workers", "0"], "--workers 0: must be a whole number >= 1"),
        ([], "no pods to follow"),
    ],
)
def test_config_check_refuses_what_run_refuses(capsys, argv, needle):
    """One validation for both: `config check` exits 2 wherever `run` would."""
    for command in (["run"], ["config", "check"]):
        assert main([*command, "--metrics-port", "0", *argv]) == 2, command
        assert needle in capsys.readouterr().err, command


def test_every_bad_setting_is_reported_at_once(capsys, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_RCVHWM", "lots")
    argv = ["--metrics-port", "0", "--reconnect-factor", "0.5", "--replay-attempts", "0"]
    argv += ["--pod", "name=a,model=m,pub=tcp://*:5557", "--pod", POD, "--shard-index", "3"]
    for command in (["run"], ["config", "check"]):
        assert main([*command, *argv]) == 2
        err = capsys.readouterr().err
        assert "5 problems in the settings:" in err, err
        for needle in (
            "reconnect_factor=0.5 (from flag)",
            "replay_attempts=0 (from flag)",
            "rcvhwm='lots' (from env KVBRIDGE_RCVHWM)",
            "pod a pub='tcp://*:5557' is a bind address",
            "shard_index=3, shard_count=1",
        ):
            assert f"  - {needle}" in err, needle
        assert "no pods to follow" not in err


def test_metrics_and_state_serve_listen_on_this_host_only_unless_told():
    """One safe default for both HTTP servers; the container image opens the metrics port."""
    from pathlib import Path

    cfg = resolve(["--pod", POD])
    assert cfg.metrics_host == "127.0.0.1"
    assert build_parser().parse_args(["state", "--serve"]).host == cfg.metrics_host
    dockerfile = (Path(__file__).parents[2] / "Dockerfile").read_text()
    assert "KVBRIDGE_METRICS_HOST=0.0.0.0" in dockerfile
    assert resolve(["--pod", POD], {"KVBRIDGE_METRICS_HOST": "0.0.0.0"}).metrics_host == "0.0.0.0"


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_librdkafka_logs_go_through_the_bridges_logging():
    """No raw ``%3|...|FAIL|...`` lines from librdkafka on the terminal; at debug level they
    are the ``kvbridge.librdkafka`` logger's."""
    from e2e_util import run_cli

    where = f"127.0.0.1:{_closed_port()}"
    got = run_cli(["consume", "--bootstrap-servers", where, "--topic", "t"], timeout=60)
    assert not [line for line in got.stderr.splitlines() if line.startswith("%")], got.stderr
    got = run_cli(
        ["consume", "--bootstrap-servers", where, "--topic", "t", "--log-level", "debug"], 60
    )
    assert not [line for line in got.stderr.splitlines() if line.startswith("%")]
    assert "DEBUG   kvbridge.librdkafka: FAIL [rdkafka#consumer-1]" in got.stderr, got.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["consume"],
        ["check"],
        ["replay"],
        ["state"],
        ["run", "--metrics-port", "0", "--pod", "name=a,model=m,pub=tcp://127.0.0.1:5"],
    ],
)
def test_an_unreachable_broker_is_one_clear_line_and_exit_2(command):
    from e2e_util import run_cli

    where = f"127.0.0.1:{_closed_port()}"
    got = run_cli([*command, "--bootstrap-servers", where], timeout=90)
    assert got.returncode == 2, got.stderr
    assert got.stderr.splitlines() == [
        f"kvbridge {command[0]}: cannot reach Kafka at {where} (Failed to get metadata: Local: "
        "Broker transport failure): check --bootstrap-servers (or KVBRIDGE_BOOTSTRAP_SERVERS), "
        "that the broker is running and that this host can connect to that address"
    ]
