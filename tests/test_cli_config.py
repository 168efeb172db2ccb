"""Run settings: flags over env over file; errors name the setting and what is accepted."""

from __future__ import annotations

import pytest

from bridge.cli import build_parser, main, resolve_run_config
from bridge.config import ConfigError, parse_pod

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
