# shellcheck shell=bash
# Run a job step and requeue the job when it checkpointed on preemption, or when it
# crashed (or ended without reporting completion) after making progress.
#
# Sourced by the sbatch scripts in jobs/. `run_with_requeue CMD...` starts CMD (an
# `srun ...` line) in the background, forwards USR1/USR2 that reach the batch shell
# (`#SBATCH --signal=B:USR1@120` signals only the batch shell) to it, and waits. A TERM
# is forwarded as USR1: srun turns a TERM of its own into a SIGKILL of every task
# ("srun: forcing job termination"), which would leave no time for the checkpoint. (A
# preemption that sends TERM to every task of the job at once cannot be caught that way:
# use `--signal` or `PreemptParameters=send_user_signal`, docs/slurm.md.) A signal that
# arrives before the step starts (the checkpoint scan below takes a while on a large
# checkpoint) is kept: the step is not started, and the job requeues. When
# the step exits with the requeue status (75, kfac_hpc.runtime.REQUEUE_EXIT_CODE: "all
# ranks checkpointed, run me again") the job is requeued with `scontrol requeue`, up to
# KFAC_MAX_RESTARTS times (SLURM_RESTART_COUNT counts them); the next run resumes from
# the latest checkpoint by itself.
#
# Crashes and node failures: any other status than those `kfac-hpc train` gives on
# purpose (0 done (but see below), 1 checkpoint write failed, 2 bad input, 3 diverged,
# 75 preempted), e.g. 137 (killed), 139 (segfault), srun's status after a node failure
# or 4 (the hang watchdog ended the job: --hang-timeout-minutes), is a crash.
# A crashed step is requeued (under the same KFAC_MAX_RESTARTS cap) only when it made
# progress: KFAC_CHECKPOINT_DIR holds a valid checkpoint (verified: format, checksums,
# no NaN/Inf) of a later step than the newest valid one when the step started. A step
# that crashes before its first new checkpoint would crash again the same way (a
# deterministic bug): it is not requeued, so it does not burn the allocation. Status 1
# follows the same rule: it is kfac-hpc train's status when a checkpoint could not be
# written, but also mpiexec's after a cut link, srun's after a node failure and Python's
# for any uncaught error; a checkpoint that keeps failing makes no progress, so it costs
# at most one more run. Statuses 2, 3 and 130 (Ctrl-C: the user asked to stop) are never
# requeued (3, NaN, is deterministic). Without KFAC_CHECKPOINT_DIR crashes are not
# requeued.
#
# Status 0 means "done" only when the run says it completed: `kfac-hpc train` writes
# KFAC_CHECKPOINT_DIR/completed after its final checkpoint (and removes an earlier one
# before it trains; so does this script before it starts the step). Open MPI's mpiexec
# (launch/local, launch/netns-nodes) exits 0 after losing a node: with
# KFAC_CHECKPOINT_DIR set, status 0 without the marker is handled like a crash
# (requeued only after progress; else the job ends with status 1). Without
# KFAC_CHECKPOINT_DIR, status 0 is "done".

KFAC_REQUEUE_EXIT_CODE=75
KFAC_COMPLETED_MARKER=completed  # kfac_hpc.checkpoint.layout.COMPLETED
: "${KFAC_MAX_RESTARTS:=10}"
: "${KFAC_PYTHON:=python}"

# Step of the newest valid checkpoint in directory $1; -1 when there is none.
kfac_checkpoint_step() {
    local dir="$1" step
    if [[ -z "$dir" || ! -d "$dir" ]]; then
        echo -1
        return 0
    fi
    if ! step=$("$KFAC_PYTHON" - "$dir" <<'PY'
import sys
from kfac_hpc.checkpoint.atomic import latest
from kfac_hpc.checkpoint.layout import step_of_name
found = latest(sys.argv[1], valid=True)
step = step_of_name(found.name) if found is not None else None
print(-1 if step is None else step)
PY
    ); then
        echo "kfac_hpc: warning: could not list the checkpoints of $dir with $KFAC_PYTHON" \
             "(its error is above): a crash will count as one without progress" >&2
        step=-1
    fi
    [[ "$step" =~ ^-?[0-9]+$ ]] || step=-1
    echo "$step"
}

KFAC_OWNER_FILE=owner  # the id of the job that trains in KFAC_CHECKPOINT_DIR

# Claim checkpoint directory $1 for this job, unless another job that is still queued
# (pending, running, requeued) holds it: a second submission of the same script, or a
# sweep without KFAC_RUN_TAG, would resume from and prune the same checkpoints. The
# owner is the job id in $1/owner (a requeued job keeps its id); without squeue (or
# outside a job) the claim is taken.
kfac_claim_dir() {
    local dir="$1" me="${SLURM_JOB_ID:-}" owner
    [[ -n "$me" ]] || return 0
    mkdir -p -- "$dir" || return 1
    owner=$(cat -- "$dir/$KFAC_OWNER_FILE" 2>/dev/null) || owner=""
    if [[ -n "$owner" && "$owner" != "$me" ]] && command -v squeue >/dev/null 2>&1 \
            && [[ -n "$(squeue -h -j "$owner" -o %i 2>/dev/null)" ]]; then
        echo "kfac_hpc: $dir is the checkpoint directory of job $owner, which is still" \
             "queued: two jobs would resume from and prune the same checkpoints. Cancel" \
             "job $owner, or give this one its own folder (KFAC_RUN_TAG=...)." >&2
        return 1
    fi
    echo "$me" > "$dir/$KFAC_OWNER_FILE.$me" && mv -f -- "$dir/$KFAC_OWNER_FILE.$me" "$dir/$KFAC_OWNER_FILE"
}

_kfac_step=""      # the job step's pid, once started
_kfac_pending=""   # a signal that reached the batch shell before the step started

_kfac_forward() {
    local sig="$1" to="$1"
    [[ "$sig" == TERM ]] && to=USR1  # srun would SIGKILL its tasks on a TERM of its own
    if [[ -z "$_kfac_step" ]]; then
        echo "kfac_hpc: batch shell got SIG$sig before the job step started"
        _kfac_pending="$to"
        return
    fi
    echo "kfac_hpc: batch shell got SIG$sig; forwarding SIG$to to the job step (pid $_kfac_step)"
    kill -s "$to" "$_kfac_step" 2>/dev/null || true
}

_kfac_late() {
    echo "kfac_hpc: batch shell got SIG$1 after the job step ended; ignored"
}

run_with_requeue() {
    _kfac_step="" _kfac_pending=""
    # from the start: a preemption may come during the checkpoint scan
    trap '_kfac_forward USR1' USR1
    trap '_kfac_forward USR2' USR2
    trap '_kfac_forward TERM' TERM
    local restarts="${SLURM_RESTART_COUNT:-0}"
    echo "kfac_hpc: job ${SLURM_JOB_ID:-?} run $((restarts + 1)) (restarts so far: $restarts, cap $KFAC_MAX_RESTARTS)"
    local start_step=-1
    if [[ -n "${KFAC_CHECKPOINT_DIR:-}" ]]; then
        kfac_claim_dir "$KFAC_CHECKPOINT_DIR" || return 2
        start_step=$(kfac_checkpoint_step "$KFAC_CHECKPOINT_DIR")
        echo "kfac_hpc: newest valid checkpoint at start: step $start_step (-1: none)"
        rm -f -- "$KFAC_CHECKPOINT_DIR/$KFAC_COMPLETED_MARKER"  # vouches for no later step
    fi
    local rc=0
    if [[ -n "$_kfac_pending" ]]; then
        echo "kfac_hpc: preempted (SIG$_kfac_pending) before the job step started: not" \
             "starting it"
        rc=$KFAC_REQUEUE_EXIT_CODE
    else
        "$@" &
        _kfac_step=$!
        if [[ -n "$_kfac_pending" ]]; then  # it came as the step was being started
            kill -s "$_kfac_pending" "$_kfac_step" 2>/dev/null || true
        fi
        while true; do
            rc=0
            wait "$_kfac_step" || rc=$?
            # `wait` also returns when a trapped signal arrives: keep waiting while the
            # step lives
            kill -0 "$_kfac_step" 2>/dev/null || break
        done
        if (( rc > 128 )); then
            # a trapped signal may have cut `wait` short just as the step ended: its
            # status is the step's (bash keeps it; 127 where it does not)
            local again=0
            wait "$_kfac_step" || again=$?
            (( again != 127 )) && rc=$again
        fi
    fi
    # From here on a repeated signal (SLURM may send it again) must not kill this shell
    # before it requeues: note it and carry on.
    trap '_kfac_late USR1' USR1
    trap '_kfac_late USR2' USR2
    trap '_kfac_late TERM' TERM
    local why
    case "$rc" in
        0)
            if [[ -z "${KFAC_CHECKPOINT_DIR:-}" \
                  || -f "$KFAC_CHECKPOINT_DIR/$KFAC_COMPLETED_MARKER" ]]; then
                echo "kfac_hpc: job step finished with status 0 (done)"
                return 0
            fi
            echo "kfac_hpc: job step ended with status 0 but the run did not report" \
                 "completion (a lost node under mpiexec?)"
            why="ended incomplete" ;;
        1)
            # kfac-hpc train's status when a checkpoint could not be written, but also a
            # launcher's after a lost node (mpiexec after a cut link, srun after a node
            # failure) and Python's for any uncaught error: the progress rule decides
            echo "kfac_hpc: job step ended with status 1 (a checkpoint could not be" \
                 "written, a node was lost, or an error)"
            why="ended with status 1" ;;
        2|3|130)
            case "$rc" in
                2) why="bad input" ;;
                130) why="interrupted (SIGINT) after a checkpoint: resubmit to continue" ;;
                *) why="training diverged (NaN/Inf): deterministic, a restart would diverge again" ;;
            esac
            echo "kfac_hpc: job step finished with status $rc ($why); not requeueing"
            return "$rc" ;;
        "$KFAC_REQUEUE_EXIT_CODE") why="preempted" ;;
        *) why="crashed" ;;
    esac
    # the job's status when not requeued (an incomplete run's 0 must not read as done)
    local failed=$(( rc == 0 ? 1 : rc ))
    if [[ "$why" == crashed ]]; then
        echo "kfac_hpc: job step crashed (status $rc: killed, segfault or node failure)"
    fi
    if [[ "$why" != preempted && -z "${KFAC_CHECKPOINT_DIR:-}" ]]; then
        echo "kfac_hpc: $why; KFAC_CHECKPOINT_DIR is not set, so progress cannot be" \
             "checked: not requeueing" >&2
        return "$rc"
    fi
    local now_step
    if [[ "$why" != preempted ]]; then
        now_step=$(kfac_checkpoint_step "$KFAC_CHECKPOINT_DIR")
        if (( now_step <= start_step )); then
            echo "kfac_hpc: $why without progress (newest valid checkpoint: step $now_step," \
                 "as at the start): not requeueing; a failure before the first new" \
                 "checkpoint would likely repeat. Fix the cause and resubmit." >&2
            return "$failed"
        fi
        echo "kfac_hpc: $why after progress (newest valid checkpoint: step $start_step ->" \
             "$now_step)"
    fi
    if (( restarts >= KFAC_MAX_RESTARTS )); then
        echo "kfac_hpc: $why, but the restart cap ($KFAC_MAX_RESTARTS) is reached:" \
             "not requeueing. Resubmit the script to continue from the last checkpoint." >&2
        [[ "$why" == preempted ]] && return 3
        return "$failed"
    fi
    if [[ "$why" == preempted ]]; then
        echo "kfac_hpc: checkpointed on preemption; requeueing job ${SLURM_JOB_ID:?}"
    else
        echo "kfac_hpc: $why; requeueing job ${SLURM_JOB_ID:?} to resume from step $now_step"
    fi
    scontrol requeue "$SLURM_JOB_ID"
    return 0
}
