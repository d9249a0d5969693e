# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv and install everything pinned in requirements.lock.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# Worker count for pytest-style knobs and the demo; CI machines have 2 cores.
JOBS ?= $(shell nproc)

.PHONY: demo test test-fast venv clean lint-duplicates slurm gpu-acceptance gpu-kit emu-check emu-test emu-sanitize emu-mutate

venv: $(STAMP)

# torch 2.14.1 (CUDA 13.0 build) is pinned in requirements.lock: see docs/kernels-and-gpus.md.
# deepspeed is built from its sdist against the installed torch, so it goes in after, without
# build isolation (an isolated build would pull a second torch into the build env). Its CPU
# shared-memory all-reduce op is compiled here, ahead of time: left to JIT, every CPU rank
# start compiled it again (~40 s) whenever two environments with different flags alternated.
$(STAMP): requirements.lock pyproject.toml setup.py $(wildcard csrc/* csrc/*/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip==24.3.1
	$(PIP) install -q -r requirements.lock
	DS_BUILD_SHM_COMM=1 $(PIP) install -q --no-build-isolation --no-cache-dir deepspeed==0.19.8
	# seqeval (NER F1 cross-check) ships only an sdist whose legacy setup.py fetches a setuptools_scm
	# that no longer builds that way; a PEP 517 build gets a working one.
	$(PIP) install -q --use-pep517 seqeval==1.2.2
	# Builds the bertdist._C extension (csrc/): CUDA kernels too where nvcc and a CUDA torch exist.
	MAX_JOBS=$(JOBS) $(PIP) install --no-build-isolation --no-deps -e .
	touch $@

# Two pytest workers (pytest-xdist): many tests wait on the processes they start, so one pytest
# process leaves a core idle much of the time (on 2 idle cores: 21.5 min, 157% CPU, against 38 min
# in one process). A file's tests stay on one worker (module fixtures are built once); the SLURM
# tests take the one-node test-bed in turn (tests/cluster/conftest.py).
TEST_WORKERS ?= 2
test: venv slurm
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=25 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): treated as failure"; exit 1; fi; \
	exit $$rc

# The fast loop: everything but the tests that start torchrun, DeepSpeed launcher, Beam worker or
# SLURM jobs, or run for long (marked `slow` or `slurm`). About 3.5 minutes on 2 cores (6 in one process).
test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m "not slow and not slurm" tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): treated as failure"; exit 1; fi; \
	exit $$rc

# One-node SLURM on localhost for the `slurm`-marked tests (idempotent). As root it starts the
# test-bed or fails loudly; without root it only says so, and `make test` goes on with the
# slurm-marked tests skipped (they give the same reason).
slurm:
	@if [ "$$(id -u)" != 0 ]; then \
		echo "make slurm: not root, so no local SLURM test-bed (installing slurm/munge and starting the daemons needs root); the slurm-marked tests will be skipped"; \
	else \
		bash cluster/testbed/slurm_up.sh; \
	fi

demo: venv
	$(PY) -m bertdist.demo --out demo_out

# The one-command GPU acceptance (docs/kernels-and-gpus.md): a report under benchmarks/results/.
# Without CUDA it runs the quick CPU variant.
gpu-acceptance: venv
	$(PY) -m bertdist.cli.main bench

# The offline kit for an air-gapped GPU node with a fixed image (docs/gpu-node.md): wheels for what
# the image lacks, pre-built records and run.sh, in GPU_KIT_OUT; fails over 48 MiB with the repository.
GPU_KIT_IMAGE ?= configs/images/gpu-node-cuda13-py312.yaml
GPU_KIT_OUT ?= dist/gpu-kit
gpu-kit: venv
	$(PY) -m bertdist.gpu_kit.build --image $(GPU_KIT_IMAGE) --out $(GPU_KIT_OUT)

# The CUDA kernels run on the CPU by the SIMT emulator (csrc/emu; docs/kernels-and-gpus.md,
# "The CUDA kernels without a GPU"). EMU_CSRC and EMU_BUILD let the mutation tests build from a mutated copy of csrc/.
# These targets need the venv only when there is none yet: their builds are incremental on
# their own (bertdist/ops/_emu_build.py), and a stale stamp must not reinstall the package.
EMU_CSRC ?= csrc
EMU_BUILD ?= build/emu
EMU_VENV := $(if $(wildcard $(PY)),,venv)

# The standalone check driver: the emulator's selftests and every kernel against the CPU twins.
emu-check: $(EMU_VENV)
	$(PY) -m bertdist.ops._emu_build driver --csrc $(EMU_CSRC) --out $(EMU_BUILD)
	$(EMU_BUILD)/check_kernels --quiet

# The emulated-kernel tests alone: the driver, then the Python-level tests (ops, entry points,
# the tiny model) against an extension built from the same sources. `make test` runs them too.
emu-test: emu-check
	$(PY) -m bertdist.ops._emu_build ext --csrc $(EMU_CSRC) --out $(EMU_BUILD)
	BERTDIST_EMU_EXT=$(EMU_BUILD)/ext/_C_emu.so $(PY) -m pytest -q -p no:cacheprovider tests/emu \
		--ignore=tests/emu/test_kernel_checks.py --ignore=tests/emu/test_mutations.py

# The driver under AddressSanitizer + UndefinedBehaviorSanitizer (any report aborts the run).
emu-sanitize: $(EMU_VENV)
	$(PY) -m bertdist.ops._emu_build driver --sanitize --csrc $(EMU_CSRC) --out $(EMU_BUILD)
	ASAN_OPTIONS=abort_on_error=1:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
		$(EMU_BUILD)/check_kernels_sanitized --quiet

# Every mutant of tests/emu/mutate.py must make `make emu-test` fail; writes benchmarks/results/.
emu-mutate: $(EMU_VENV)
	$(PY) tests/emu/mutate.py --record

clean:
	rm -rf $(VENV) build *.egg-info demo_out
