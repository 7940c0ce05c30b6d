# shellcheck shell=bash
# Sourced by launch/local and tests/run_gpu.sh (not a command): Open MPI 4 on one node
# without ssh.
#
# Open MPI 4 (ORTE) stops at once without ssh or rsh on PATH ("plm_rsh_agent: ssh : rsh
# ... could not be found", exit 243), even for ranks on this node only, and so does a
# process that calls MPI_Init without mpiexec (it starts its own ORTE daemon), unless
# another launcher is chosen: its "isolated" one starts processes on this node only.
# Open MPI 5 (PRRTE) needs no ssh here.

# ompi4_needs_isolated VERSION: true when VERSION (`mpiexec --version`'s output) is Open
# MPI 4's, neither ssh nor rsh is on PATH, and no launcher or agent was chosen in this
# environment (OMPI_MCA_plm, OMPI_MCA_plm_rsh_agent, OMPI_MCA_orte_rsh_agent: left alone).
ompi4_needs_isolated() {
    grep -qi openrte <<< "$1" \
        && ! [[ -x "$(type -P ssh)" || -x "$(type -P rsh)" ]] \
        && [[ -z "${OMPI_MCA_plm+set}${OMPI_MCA_plm_rsh_agent+set}${OMPI_MCA_orte_rsh_agent+set}" ]]
}
