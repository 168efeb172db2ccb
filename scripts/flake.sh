#!/usr/bin/env bash
# Run the whole test suite N times in a row (default 5) and report what failed in each run:
#   scripts/flake.sh [N] [pytest args...]      e.g. scripts/flake.sh 5 -x
# Each run's output goes to .flake/run-K.log; the summary lists every failed or errored test
# per run and the flake rate (runs with any failure / runs). Exit 1 if any run failed.
# Installs nothing: run scripts/test.sh once first (it installs the packages and the jars).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNS="${1:-5}"
shift || true
source scripts/python-env.sh  # the same interpreter as scripts/test.sh
OUT=.flake
mkdir -p "$OUT"
failed_runs=0
for ((k = 1; k <= RUNS; k++)); do
    log="$OUT/run-$k.log"
    start=$(date +%s)
    "$PYTHON" -m pytest -q -p no:cacheprovider -rfE "$@" >"$log" 2>&1
    rc=$?
    secs=$(($(date +%s) - start))
    summary="$(tail -n 1 "$log")"
    echo "run $k/$RUNS: exit $rc in ${secs}s: $summary"
    if ((rc != 0)); then
        failed_runs=$((failed_runs + 1))
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
    fi
done
echo "flake rate: $failed_runs of $RUNS runs had a failure (logs in $OUT/)"
((failed_runs == 0))
