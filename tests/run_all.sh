#!/usr/bin/env bash
# The whole test suite: serial tests, then MPI tests on 2 and 4 ranks, then the tests
# across nodes (network namespaces; skipped, saying why, where they cannot be made).
# Every MPI run has a hard timeout and aborts on the first failure on any rank.
# pytest's exit code 5 ("no tests collected") is accepted for a stage and reported.
# STAGES (default "serial mpi-2 mpi-4 multinode") picks the stages that run.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PYTHON="${PYTHON:-python}"
MPI_TIMEOUT="${MPI_TIMEOUT:-2400}"
STAGES=" ${STAGES:-serial mpi-2 mpi-4 multinode} "
status=0

wanted() { [[ "$STAGES" == *" $1 "* ]]; }

run_stage() {
    local name="$1"; shift
    echo "=== $name: $*"
    local start=$SECONDS
    "$@"
    local rc=$?
    if [[ $rc -eq 5 ]]; then
        echo "=== $name: no tests collected (exit 5), accepted"
        rc=0
    fi
    echo "=== $name: exit $rc in $((SECONDS - start)) s"
    [[ $rc -eq 0 ]] || status=1
}

if wanted serial; then
    run_stage serial "$PYTHON" -m pytest -q --with-mpi -p no:cacheprovider \
        --ignore=tests/multinode "$@"
fi
for n in 2 4; do
    wanted "mpi-$n" || continue
    run_stage "mpi-$n" launch/local -n "$n" --timeout "$MPI_TIMEOUT" \
        "$PYTHON" -m mpi4py -m pytest -q --with-mpi --only-mpi -p no:cacheprovider \
        --ignore=tests/multinode "$@"
done
# Nodes as network namespaces on this machine (docs/multinode.md): root and `ip netns`
if wanted multinode; then
    if why=$(launch/netns-nodes --why-not); then
        run_stage multinode "$PYTHON" -m pytest -q -p no:cacheprovider tests/multinode "$@"
    else
        echo "=== multinode: skipped: no nodes on this machine: $why"
    fi
fi
exit $status
