#!/usr/bin/env bash
# The GPU tests (tests/gpu, marked gpu), as `make gpu-test` runs them (docs/gpu.md): every
# module serially, then every module on RANKS MPI ranks sharing the GPU(s). One pytest
# (one mpiexec) per module, each under its own time limit, so a module that aborts or
# hangs cannot hide the results of the others. Under MPI the first failing test aborts
# every rank (tests/conftest.py); the harness records that test (and the test in
# progress on each rank) first, and the module runs again without it, until it runs to
# the end: every failing test is reported, not only the first. Prints a line per module
# and per stage,
#
#   === <stage>: N passed, M failed, K skipped (exit R) in S s
#
# counted from each rank's JUnit report (a test fails if it fails on any rank) plus the
# tests that took a run down, then at the end the stage lines again and every failing
# test. R is the first non-zero exit of the stage's runs (0 when all passed). Exits 1
# when any stage failed. pytest's exit 5 (no tests collected, e.g. a module without MPI
# tests) is accepted.
#
#   PYTHON=python3 RANKS=2 MPI_TIMEOUT=1800 tests/run_gpu.sh [PYTEST ARGS...]
#
# GPU_TEST_MODULES (space-separated paths) narrows the modules; pytest arguments (-k ...)
# go to every run. MAX_RERUNS (10) bounds the reruns of one module. JOBS (1) runs that
# many modules of a stage at a time (sharing the GPUs; a machine with the cores for it),
# each module's output printed whole, in module order, once it and those before it ended.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PYTHON="${PYTHON:-python3}"
# Open MPI 4 on a machine without ssh or rsh: every serial run (pytest --with-mpi calls
# MPI_Init without mpiexec) needs its local-node launcher, as launch/local gives mpiexec.
# shellcheck source=launch/ompi4.sh
source launch/ompi4.sh
if ompi4_needs_isolated "$("${MPIEXEC:-mpiexec}" --version 2>/dev/null)"; then
    export OMPI_MCA_plm=isolated
fi
RANKS="${RANKS:-2}"
MPI_TIMEOUT="${MPI_TIMEOUT:-1800}"
SERIAL_TIMEOUT="${SERIAL_TIMEOUT:-$MPI_TIMEOUT}"
MAX_RERUNS="${MAX_RERUNS:-10}"
JOBS="${JOBS:-1}"
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "run_gpu: JOBS must be a positive integer, got '$JOBS'" >&2; exit 2; }
read -r -a modules <<< "${GPU_TEST_MODULES:-$(echo tests/gpu/test_*.py)}"
[[ ${#modules[@]} -gt 0 && -f "${modules[0]}" ]] || { echo "run_gpu: no test modules" >&2; exit 2; }

# Colour only for a terminal (ranks under mpiexec always see one).
color=no
[[ -t 1 ]] && color=yes
reports="$(mktemp -d "${TMPDIR:-/tmp}/kfac_hpc-gpu-reports.XXXXXX")" || exit 2
trap 'rm -rf "$reports"' EXIT
# Interrupted or timed out: end the modules running in the background (JOBS > 1; they
# ignore SIGINT) and what they started, then exit (the EXIT trap cleans up).
# shellcheck disable=SC2329  # called by the INT and TERM traps
stop_jobs() {
    local pid
    for pid in $(jobs -p); do
        pkill -TERM -P "$pid" 2>/dev/null
        kill -TERM "$pid" 2>/dev/null
    done
}
trap 'stop_jobs; exit 130' INT
trap 'stop_jobs; exit 143' TERM
summary=()   # one "=== stage: ..." line per stage
failures=()  # one line per failing test, and per module that ended without its reports
status=0

# Count one run's JUnit reports (one per rank): prints "passed failed skipped reports",
# then one line per failing test ("<node id> (rank R,...)").
count() {
    "$PYTHON" - "$1" "$2" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

folder, module = Path(sys.argv[1]), sys.argv[2]
dotted = module[:-3].replace("/", ".")
outcomes: dict[str, dict[str, str]] = {}
files = sorted(folder.glob("rank*.xml"))
for file in files:
    rank = file.stem[4:]
    for case in ET.parse(file).getroot().iter("testcase"):
        cls = case.get("classname", "")
        inner = cls[len(dotted):].lstrip(".").replace(".", "::") if cls.startswith(dotted) else cls
        node = "::".join(p for p in (module, inner, case.get("name", "")) if p)
        tags = {child.tag for child in case}
        outcome = ("failed" if tags & {"failure", "error"} else
                   "skipped" if "skipped" in tags else "passed")
        outcomes.setdefault(node, {})[rank] = outcome
counts = {"passed": 0, "failed": 0, "skipped": 0}
failing = []
for node, by_rank in outcomes.items():
    seen = set(by_rank.values())
    outcome = "failed" if "failed" in seen else "passed" if "passed" in seen else "skipped"
    counts[outcome] += 1
    if outcome == "failed":
        ranks = ",".join(r for r, o in sorted(by_rank.items()) if o == "failed")
        failing.append(f"{node} (rank {ranks})")
print(counts["passed"], counts["failed"], counts["skipped"], len(files))
print("\n".join(failing))
EOF
}

# The tests a dead run was in, one "<node id>\t<what>" a line: the failed tests recorded
# before the abort; without any, the tests in progress on the ranks (a crash or a hang).
culprits() {
    local dir="$1" kind file rank id when
    local -A on_ranks=() phase=()
    local order=()
    for kind in failed running; do
        for file in "$dir/$kind"-rank*; do
            [[ -f "$file" ]] || continue
            rank="${file##*-rank}"
            while IFS=$'\t' read -r id when; do
                [[ -n "$id" ]] || continue
                [[ -n "${on_ranks[$id]:-}" ]] || order+=("$id")
                on_ranks[$id]+="${on_ranks[$id]:+,}$rank"
                phase[$id]="$when"
            done < "$file"
        done
        [[ ${#order[@]} -eq 0 ]] || break
    done
    for id in "${order[@]}"; do
        if [[ $kind == failed ]]; then
            printf '%s\tfailed on rank %s (%s), which took the run down\n' \
                "$id" "${on_ranks[$id]}" "${phase[$id]}"
        else
            printf '%s\tin progress on rank %s when the run died (crash, abort or timeout)\n' \
                "$id" "${on_ranks[$id]}"
        fi
    done
}

# run_module STAGE RANKS MODULE DIR [PYTEST ARGS...]: one run, reports into DIR.
run_module() {
    local name="$1" ranks="$2" module="$3" dir="$4"; shift 4
    mkdir -p "$dir"
    if [[ $ranks -eq 0 ]]; then
        KFAC_HPC_TEST_RECORD="$dir" timeout --foreground --kill-after=30 "$SERIAL_TIMEOUT" \
            "$PYTHON" -m pytest -q --with-mpi -p no:cacheprovider --color="$color" -m gpu \
            --junitxml="$dir/rank0.xml" "$module" "$@"
    else
        # Each rank writes its own report, rank<R>.xml (Open MPI, PMIx or PMI rank).
        # shellcheck disable=SC2016  # expanded by each rank's shell, not here
        KFAC_HPC_TEST_RECORD="$dir" launch/local -n "$ranks" --timeout "$MPI_TIMEOUT" \
            /bin/sh -c 'py=$0 dir=$1; shift
                rank=${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${PMI_RANK:-0}}}
                exec "$py" -m mpi4py -m pytest --junitxml="$dir/rank$rank.xml" "$@"' \
            "$PYTHON" "$dir" -q --with-mpi --only-mpi -p no:cacheprovider --color="$color" \
            -m gpu "$module" "$@"
    fi
}

# module_runs STAGE RANKS MODULE OUT [PYTEST ARGS...]: one module's runs, again without the
# tests that took a run down; its counts go to OUT/result ("passed failed skipped rc"),
# its failing tests to OUT/failures, a module that ended without its reports to
# OUT/missing.
module_runs() {
    local name="$1" ranks="$2" module="$3" out="$4"; shift 4
    local t0=$SECONDS module_rc=0 attempt=0 deselect=() n_failed=0 note="" lost=0
    local expected=$(( ranks == 0 ? 1 : ranks ))
    local dir rc found id what counts n_passed n_skipped line
    mkdir -p "$out"
    : > "$out/failures"
    while :; do
        attempt=$((attempt + 1))
        dir="$out/$attempt"
        echo "--- $name $module:$([[ $ranks -eq 0 ]] || echo " launch/local -n $ranks") $PYTHON -m pytest $module${deselect[*]:+ ${deselect[*]}}"
        run_module "$name" "$ranks" "$module" "$dir" "$@" "${deselect[@]}"
        rc=$?
        [[ $rc -eq 0 ]] || echo  # after a run killed mid-line (or MPI's abort notice): a new line
        [[ $rc -eq 5 ]] && rc=0  # no tests collected: accepted
        [[ $module_rc -ne 0 ]] || module_rc=$rc
        shopt -s nullglob
        local xmls=("$dir"/rank*.xml)
        shopt -u nullglob
        [[ ${#xmls[@]} -lt $expected ]] || break
        # The run died before every rank wrote its report: name the test, rerun without.
        found=0
        while IFS=$'\t' read -r id what; do
            [[ -n "$id" ]] || continue
            found=1 lost=$((lost + 1))
            echo "FAILED ($name) $id: $what" >> "$out/failures"
            deselect+=("--deselect=$id")
        done <<< "$(culprits "$dir")"
        if [[ $found -eq 0 || $attempt -gt $MAX_RERUNS ]]; then
            note="; no report from $((expected - ${#xmls[@]})) of $expected rank(s): died outside a test or after $MAX_RERUNS reruns"
            echo "$(basename "$module") (exit $rc)" > "$out/missing"
            echo "ABORTED ($name) $module: exit $rc, $((expected - ${#xmls[@]})) rank(s) without a report" >> "$out/failures"
            [[ $module_rc -ne 0 ]] || module_rc=1
            break
        fi
        echo "--- $name $module: exit $rc in a test; again without the test(s) that took it down"
    done
    counts="$(count "$dir" "$module")"
    read -r n_passed n_failed n_skipped _ <<< "${counts%%$'\n'*}"
    n_failed=$(( ${n_failed:-0} + lost ))
    while IFS= read -r line; do
        [[ -n "$line" ]] && echo "FAILED ($name) $line" >> "$out/failures"
    done <<< "$(tail -n +2 <<< "$counts")"
    [[ $module_rc -eq 0 && $n_failed -gt 0 ]] && module_rc=1
    [[ $attempt -eq 1 ]] || note="; $attempt runs$note"
    echo "--- $name $module: ${n_passed:-0} passed, $n_failed failed, ${n_skipped:-0} skipped (exit $module_rc) in $((SECONDS - t0)) s$note"
    echo "${n_passed:-0} $n_failed ${n_skipped:-0} $module_rc" > "$out/result"
}

# run_stage NAME RANKS [PYTEST ARGS...]: every module, serially (RANKS 0) or on RANKS ranks;
# JOBS modules at a time (each module's output then printed whole, in module order, as
# soon as it and the modules before it have ended).
run_stage() {
    local name="$1" ranks="$2"; shift 2
    local start=$SECONDS passed=0 failed=0 skipped=0 stage_rc=0 missing=()
    local module out n_passed n_failed n_skipped module_rc line i outs=() shown=0
    local how="serially"
    [[ $ranks -eq 0 ]] || how="each on $ranks MPI ranks"
    [[ $JOBS -le 1 ]] || how+=", $JOBS at a time"
    echo "=== $name: ${#modules[@]} module(s), $how${*:+, pytest args: $*}"
    for i in "${!modules[@]}"; do
        module="${modules[$i]}"
        out="$reports/$name/$i-$(basename "$module" .py)"  # a module listed twice: two
        outs+=("$out")
        if [[ $JOBS -le 1 ]]; then
            module_runs "$name" "$ranks" "$module" "$out" "$@"
            continue
        fi
        while [[ $(jobs -rp | wc -l) -ge $JOBS ]]; do
            wait -n
            while [[ $shown -lt $i && -f "${outs[$shown]}/result" ]]; do
                cat "${outs[$shown]}/log"
                shown=$((shown + 1))
            done
        done
        mkdir -p "$out"
        module_runs "$name" "$ranks" "$module" "$out" "$@" > "$out/log" 2>&1 &
    done
    wait
    for i in "${!modules[@]}"; do
        module="${modules[$i]}" out="${outs[$i]}"
        [[ $JOBS -le 1 || $i -lt $shown ]] || cat "$out/log"
        touch "$out/failures"
        if [[ ! -f "$out/result" ]] \
                || ! read -r n_passed n_failed n_skipped module_rc < "$out/result"; then
            n_passed=0 n_failed=1 n_skipped=0 module_rc=1
            echo "ABORTED ($name) $module: ended without its counts" >> "$out/failures"
            echo "$(basename "$module") (no counts)" > "$out/missing"
        fi
        passed=$((passed + n_passed)) failed=$((failed + n_failed))
        skipped=$((skipped + n_skipped))
        [[ $stage_rc -ne 0 ]] || stage_rc=$module_rc
        while IFS= read -r line; do
            [[ -n "$line" ]] && failures+=("$line")
        done < "$out/failures"
        [[ ! -f "$out/missing" ]] || missing+=("$(cat "$out/missing")")
    done
    line="=== $name: $passed passed, $failed failed, $skipped skipped (exit $stage_rc) in $((SECONDS - start)) s"
    [[ ${#missing[@]} -eq 0 ]] || line+="; no report: ${missing[*]}"
    echo "$line"
    summary+=("$line")
    [[ $stage_rc -eq 0 ]] || status=1
}

run_stage gpu-serial 0 "$@"
run_stage "gpu-mpi-$RANKS" "$RANKS" "$@"

echo "=== gpu-test summary"
printf '%s\n' "${summary[@]}"
[[ ${#failures[@]} -eq 0 ]] || printf '%s\n' "${failures[@]}"
exit $status
