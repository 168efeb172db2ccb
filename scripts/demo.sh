#!/usr/bin/env bash
# The kvbridge demo, no Docker needed: a local Kafka broker, three simulated vLLM pods
# (releases 0.9.0, 0.23.0, 0.33.0; 5% of live messages dropped), `kvbridge run`, then what
# `kvbridge consume` and `kvbridge replay` rebuild from the topic. Stops all it started.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/python-env.sh
source scripts/python-env.sh  # PYTHON: an active venv, else .venv/ (created)

echo "== installing kvbridge (pip install -e .; up to a minute on a fresh machine)"
"$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore -e .
echo "== Kafka jars (from Maven Central the first time, then cached in .kafka-local/)"
bash scripts/kafka-local.sh fetch

WORK="$(mktemp -d -t kvbridge-demo-XXXXXX)"
read -r KAFKA_PORT CONTROLLER_PORT < <("$PYTHON" - <<'PY'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)
cleanup() {
    bash scripts/kafka-local.sh stop --data-dir "$WORK/kafka" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

echo "== starting Kafka on 127.0.0.1:$KAFKA_PORT (about 10 s)"
bash scripts/kafka-local.sh start --port "$KAFKA_PORT" --controller-port "$CONTROLLER_PORT" \
    --data-dir "$WORK/kafka" >/dev/null
"$PYTHON" scripts/demo.py --bootstrap-servers "127.0.0.1:$KAFKA_PORT" --workdir "$WORK"
