# shellcheck shell=bash
# drop_mpi_runtime_vars: unset the MPI runtime's variables (launch/mpi-runtime-vars.txt)
# in this shell, keeping the settings a user makes.

_mpi_runtime_patterns=()
while IFS= read -r _line; do
    [[ -z "$_line" || "$_line" == \#* ]] || _mpi_runtime_patterns+=("$_line")
done < "$(dirname "${BASH_SOURCE[0]}")/mpi-runtime-vars.txt"
unset _line

# mpi_runtime_var NAME: whether NAME is a variable of the MPI runtime (the first line
# of launch/mpi-runtime-vars.txt that matches decides; "!" lines keep).
mpi_runtime_var() {
    local pattern
    for pattern in "${_mpi_runtime_patterns[@]}"; do
        if [[ "$pattern" == !* ]]; then
            # shellcheck disable=SC2053  # the pattern is a glob
            [[ "$1" == ${pattern#!} ]] && return 1
        else
            # shellcheck disable=SC2053
            [[ "$1" == $pattern ]] && return 0
        fi
    done
    return 1
}

drop_mpi_runtime_vars() {
    local name
    for name in $(compgen -e); do
        if mpi_runtime_var "$name"; then
            unset "$name"
        fi
    done
}
