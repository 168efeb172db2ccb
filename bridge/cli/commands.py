"""The `kvbridge` command: every subcommand's parser in one, and the dispatch to them.

Each subcommand lives in its own module here (``run``, ``configcheck``, ``simulate``,
``state``, ``check``, ``read``); errors a user can fix end as one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from confluent_kafka import KafkaException

from bridge import __version__
from bridge.cli import check, configcheck, read, run, simulate, state
from bridge.cli.args import Parser
from bridge.ops.config import ConfigError, KafkaUnreachable, env_settings, kafka_unreachable
from bridge.ops.logsetup import setup_logging

DESCRIPTION = """\
kvbridge follows vLLM engines' KV-cache event streams (ZeroMQ PUB + replay ROUTER), keeps
every (pod, data-parallel rank) stream complete and ordered, and writes each event as an
Avro record to a Kafka topic keyed by pod, so consumers can rebuild each pod's prefix-cache
state from any offset or time.

  kvbridge run --bootstrap-servers localhost:9092 \\
      --pod name=pod-a,model=llama,pub=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558
  kvbridge consume --from-beginning --pod pod-a      # events as JSON lines
  kvbridge replay                                    # rebuilt cache state per pod
  kvbridge simulate --pods 3                         # simulated vLLM pods for trying it out
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvbridge",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    configcheck.configure_parser(sub, run.configure_parser(sub))
    simulate.configure_parser(
        sub.add_parser(
            "simulate",
            help="run simulated vLLM pods (PUB + replay ROUTER) for demos and tests",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    state.configure_sync_parser(sub)
    state.configure_state_parser(sub)
    check.configure_parser(
        sub.add_parser("check", help="verify the topic: contiguity, duplicates, markers")
    )
    for name, helptext in (
        ("consume", "print the topic's records as JSON lines"),
        ("replay", "rebuild per-pod cache state from the topic and print it"),
    ):
        read.configure_reader_parser(sub.add_parser(name, help=helptext), name)
    return parser


def _run(args: argparse.Namespace) -> int:
    commands = {
        "run": run.run,
        "config": lambda a: configcheck.run_config_check(a, run.resolve_run_config),
        "simulate": simulate.run,
        "state-sync": state.run_sync,
        "state": state.run_state,
        "check": check.run,
        "consume": read.cmd_consume,
        "replay": read.cmd_replay,
    }
    return commands[args.command](args)


def main(argv: list[str] | None = None) -> int:
    """`kvbridge`'s entry point: the exit code of the command run."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    try:
        return _run(args)
    except ConfigError as exc:
        print(f"kvbridge {args.command}: {exc}", file=sys.stderr)
        return 2
    except KafkaUnreachable as exc:
        print(f"kvbridge {args.command}: {exc}", file=sys.stderr)
        return 2
    except KafkaException as exc:
        if not kafka_unreachable(exc):
            raise
        where = getattr(args, "bootstrap_servers", None) or env_settings().get(
            "bootstrap_servers", "localhost:9092"
        )
        print(
            f"kvbridge {args.command}: {KafkaUnreachable(where, exc.args[0].str())}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        print(f"kvbridge {args.command}: {exc}", file=sys.stderr)
        return 1
