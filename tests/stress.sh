#!/usr/bin/env bash
# `make test-stress`: the suite on a busy machine. Two busy processes (`while True: pass`), pinned to CPUs 0 and 1
# with taskset, run beside the whole suite (`-m "not distributed and not stress"`, in `make test`'s pytest-xdist
# workers), then beside the engine suite (`-m distributed`, OMP_NUM_THREADS=1 as `make test-distributed` runs it),
# then beside the teardown stress test (`-m stress`, TRINITY_STRESS_REPEATS launches per engine, 10 unless set; told
# not to start busy processes of its own); each part's wall time and the load average are printed.
# The busy processes are killed on exit, however the script ends. Usage: tests/stress.sh [python] [pytest args...]
# `tests/stress.sh --ci` (`make ci-stress`) instead runs CI itself (.ci/run, install included) on a clean clone of
# HEAD in a temporary folder beside the same two busy processes.
set -uo pipefail
cd "$(dirname "$0")/.."
CI=0
if [ "${1:-}" = "--ci" ]; then
    CI=1
    shift
fi
PY=${1:-.venv/bin/python}
shift || true
TEST_WORKERS=${TEST_WORKERS:-2}  # pytest-xdist workers of the whole suite (make passes its own)

busy=()
stop_busy() {
    for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null; done
    wait "${busy[@]}" 2>/dev/null
}
trap stop_busy EXIT
trap 'exit 130' INT TERM

BUSY_PY=$PY
[ -x "$BUSY_PY" ] || BUSY_PY=python3
for cpu in 0 1; do
    if command -v taskset >/dev/null; then
        taskset -c "$cpu" "$BUSY_PY" -c 'while True: pass' &
    else
        "$BUSY_PY" -c 'while True: pass' &
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
if [ "$CI" -eq 1 ]; then
    clone=$(mktemp -d)
    git clone -q . "$clone" && echo "stress: CI on a clean clone of $(git rev-parse --short HEAD) in $clone"
    part "CI (.ci/run, install included)" "$clone/.ci/run"
    rm -rf "$clone"
    exit "$status"
fi
part "whole suite (-m 'not distributed and not stress', $TEST_WORKERS workers)" \
    "$PY" -m pytest -q -n "$TEST_WORKERS" -m "not distributed and not stress" "$@"
part "engine suite (-m distributed)" env OMP_NUM_THREADS=1 "$PY" -m pytest -q -m distributed "$@"
part "teardown stress (-m stress, ${TRINITY_STRESS_REPEATS:-10} launches per engine)" \
    env OMP_NUM_THREADS=1 TRINITY_STRESS_BUSY=0 "$PY" -m pytest -q -s -m stress "$@"
exit "$status"
