#!/usr/bin/env bash
# `make test-stress`: the suite on a busy machine. Two busy processes (`while True: pass`), pinned to CPUs 0 and 1
# with taskset, run beside the whole suite (`-m "not distributed"`), then beside the engine suite (`-m distributed`,
# OMP_NUM_THREADS=1 as `make test-distributed` runs it); each part's wall time and the load average are printed.
# The busy processes are killed on exit, however the script ends. Usage: tests/stress.sh [python] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
shift || true

busy=()
stop_busy() {
    for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null; done
    wait "${busy[@]}" 2>/dev/null
}
trap stop_busy EXIT
trap 'exit 130' INT TERM

for cpu in 0 1; do
    if command -v taskset >/dev/null; then
        taskset -c "$cpu" "$PY" -c 'while True: pass' &
    else
        "$PY" -c 'while True: pass' &
    fi
    busy+=($!)
done
echo "stress: busy processes ${busy[*]} pinned to CPUs 0 and 1; load average $(cut -d' ' -f1-3 /proc/loadavg)"

status=0
part() {
    local name=$1
    shift
    local start=$SECONDS
    "$@"
    local rc=$?
    echo "stress: $name: exit $rc, $((SECONDS - start)) s wall, load average $(cut -d' ' -f1-3 /proc/loadavg)"
    [ "$rc" -eq 0 ] || status=$rc
}
part "whole suite (-m 'not distributed')" "$PY" -m pytest -q -m "not distributed" "$@"
part "engine suite (-m distributed)" env OMP_NUM_THREADS=1 "$PY" -m pytest -q -m distributed "$@"
exit "$status"
