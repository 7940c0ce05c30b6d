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
