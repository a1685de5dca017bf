# One entry point. `make demo` runs the default job, `make test` runs the test suite; both create
# .venv and install everything on first use.
#
# Which torch: TORCH_SPEC/TORCH_INDEX choose the build installed into .venv before the project.
# The default is the CPU build that CI uses. On a GPU machine pick a CUDA build, e.g.
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cu128
# or install your own torch into .venv first: a torch that is already importable is kept.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
NPROC ?= 2
# The suite runs TEST_JOBS test files at once (pytest-xdist; a file's tests stay on one worker,
# so a module's reference run is made once). Its tests mostly wait on launched workers that
# import torch: two jobs keep a 2-core machine's cores busy.
TEST_JOBS ?= 2
CONFIG ?= configs/tiny.yaml
# Every dependency but torch is pinned by the lock the images use; LOCK= installs from ranges.
LOCK ?= docker/requirements.lock

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-deploy lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml docker/requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q $(if $(LOCK),-c $(LOCK)) -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node $(NPROC) -m launcher --config $(CONFIG)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/hadolint docker/Dockerfile docker/Dockerfile.cpu
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

# The second stage (root; CI runs it after `test`): the CPU image built and run by a real podman,
# the Slurm recipe run by a real Slurm on this host. Installs Debian's podman, runc, debootstrap,
# slurm-wlm and munge when missing; caches the debootstrapped base image and a wheelhouse under
# ~/.cache/resumable-trainer/. About 4 minutes on 2 cores with those caches (and podman's layer
# cache), a few more without.
test-deploy: $(STAMP)
	$(BIN)/python -m tests.deploy.podman_setup
	$(BIN)/python -m tests.deploy.slurm install
	$(BIN)/python -m pytest -m deploy tests/deploy -s -rA --durations=0

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) runs .pytest_cache
