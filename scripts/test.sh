#!/usr/bin/env bash
# The project's test command (README, CI): installs what the tests need, lints, runs pytest.
# Needs Python 3.11, Java 17 and Maven; arguments go to pytest (e.g. scripts/test.sh -k kafka).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/python-env.sh
source scripts/python-env.sh  # PYTHON: an active venv, else .venv/ (created)

echo "== pip install -e '.[test]'"
"$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore -e '.[test]'

echo "== Kafka jars (scripts/kafka-local.sh fetch)"
bash scripts/kafka-local.sh fetch

if ! command -v docker-compose >/dev/null; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        echo "== apt-get install docker-compose (validates docker-compose.yml)"
        if ! log="$( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends docker-compose) 2>&1)"; then
            echo "$log" >&2
            exit 1
        fi
    else
        echo "warning: docker-compose is missing and cannot be installed (not root):" \
            "tests/deploy/test_compose.py will fail; install Debian's docker-compose package" >&2
    fi
fi

echo "== ruff"
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .

echo "== pytest"
"$PYTHON" -m pytest -q --durations=15 "$@"
