# shellcheck shell=bash
# Run a job step and requeue the job when it checkpointed on preemption.
#
# Sourced by the sbatch scripts in jobs/. `run_with_requeue CMD...` starts CMD (an
# `srun ...` line) in the background, forwards USR1/USR2/TERM that reach the batch shell
# (`#SBATCH --signal=B:USR1@120` signals only the batch shell) to it, and waits. When
# the step exits with the requeue status (75, kfac_hpc.runtime.REQUEUE_EXIT_CODE: "all
# ranks checkpointed, run me again") the job is requeued with `scontrol requeue`, up to
# KFAC_MAX_RESTARTS times (SLURM_RESTART_COUNT counts them); the next run resumes from
# the latest checkpoint by itself.

KFAC_REQUEUE_EXIT_CODE=75
: "${KFAC_MAX_RESTARTS:=10}"

_kfac_forward() {
    local sig="$1"
    echo "kfac_hpc: batch shell got SIG$sig; forwarding it to the job step (pid $_kfac_step)"
    kill -s "$sig" "$_kfac_step" 2>/dev/null || true
}

_kfac_late() {
    echo "kfac_hpc: batch shell got SIG$1 after the job step ended; ignored"
}

run_with_requeue() {
    local restarts="${SLURM_RESTART_COUNT:-0}"
    echo "kfac_hpc: job ${SLURM_JOB_ID:-?} run $((restarts + 1)) (restarts so far: $restarts, cap $KFAC_MAX_RESTARTS)"
    "$@" &
    _kfac_step=$!
    trap '_kfac_forward USR1' USR1
    trap '_kfac_forward USR2' USR2
    trap '_kfac_forward TERM' TERM
    local rc=0
    while true; do
        rc=0
        wait "$_kfac_step" || rc=$?
        # `wait` also returns when a trapped signal arrives: keep waiting while the step lives
        kill -0 "$_kfac_step" 2>/dev/null || break
    done
    # From here on a repeated signal (SLURM may send it again) must not kill this shell
    # before it requeues: note it and carry on.
    trap '_kfac_late USR1' USR1
    trap '_kfac_late USR2' USR2
    trap '_kfac_late TERM' TERM
    if [[ "$rc" -ne "$KFAC_REQUEUE_EXIT_CODE" ]]; then
        echo "kfac_hpc: job step finished with status $rc"
        return "$rc"
    fi
    if (( restarts >= KFAC_MAX_RESTARTS )); then
        echo "kfac_hpc: checkpointed, but the restart cap ($KFAC_MAX_RESTARTS) is reached:" \
             "not requeueing. Resubmit the script to continue from the last checkpoint." >&2
        return 3
    fi
    echo "kfac_hpc: checkpointed on preemption; requeueing job ${SLURM_JOB_ID:?}"
    scontrol requeue "$SLURM_JOB_ID"
    return 0
}
