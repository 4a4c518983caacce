# The two commands of the README: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR := .packbench
export RAY_AUTH_MODE ?= disabled

.PHONY: demo test venv browser clean mutate

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: 2.13.0 is the CPU build on local disk; a bare "torch" would fetch CUDA wheels.
# The [offload] extra (deepspeed) is an sdist whose build imports torch: built against the torch
# above with --no-build-isolation (an isolated build would fetch a second, CUDA torch), so the build
# backends go in first; its tests run in `make test` (their own pytest process, below).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q 'setuptools>=77' wheel
	$(BIN)/python -m pip install -q --no-build-isolation -e '.[test,offload]'
	touch $(STAMP)

# The [llamacpp] extra for the llama-cpp tests (engine/llama_cpp.py), in `make test` only: llama-cpp-python
# is an sdist that builds llama.cpp (about 3 min on 2 cores: its CPU backend, portable AVX2 code, the
# multimodal library off; pip keeps the wheel it built in its cache). A CUDA build for a GPU worker:
# CMAKE_ARGS='-DGGML_CUDA=on' pip install 'packbench[llamacpp]'.
LLAMA_STAMP := $(VENV)/.installed-llamacpp
$(LLAMA_STAMP): pyproject.toml | $(STAMP)
	CMAKE_ARGS="$${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF}" $(BIN)/python -m pip install -q -e '.[llamacpp]'
	touch $(LLAMA_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/packbench model synth --shape tiny --dtype float32 --profile opt --seed 0 --out $(DEMO_DIR)/models/tiny --force
	$(BIN)/packbench db upgrade
	$(BIN)/packbench submit protocols/quickstart.yaml --wait
	$(BIN)/packbench audit latest
	$(BIN)/packbench results --screen latest
	$(BIN)/packbench report latest --out $(DEMO_DIR)/report.html

# The report's browser tests open pages in headless Chromium (Debian's package chromium), which a
# fresh machine lacks: installed here when missing, where this runs as root with apt-get.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  echo "installing headless Chromium (apt-get install chromium) for the report's browser tests" && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "warning: headless Chromium is missing and could not be installed here (needs root and apt-get): the report's browser tests will fail; install Debian's chromium package"

# The deepspeed tests in a second pytest process: DeepSpeed binds its accelerator and a one-rank
# process group for the life of a process (engine/zero_inference.py), state no other test should
# run beside. The cause of their Ray test failing after the in-process ones (a rendezvous left in
# the environment) is fixed, so the split isolates DeepSpeed's process-wide state, not a known bug.
test: $(STAMP) $(LLAMA_STAMP) browser
	$(BIN)/python -m pytest -q --durations=15 -m "not gpu and not deepspeed and not flexgen"
	$(BIN)/python -m pytest -q -m deepspeed tests/engine/test_zero_inference.py
	$(BIN)/python -m pytest -q -m flexgen tests/engine/test_flexgen_cpu.py

# Mutation testing (mutmut) of the modules that decide verdicts and evidence, each against its own
# tests, one worker, module by module (docs/mutation.md); not part of `make test`.
# `make mutate MODULES="core/gates.py core/audit.py"` runs some; a rerun resumes where one stopped.
MUTATE_STAMP := $(VENV)/.installed-mutate
$(MUTATE_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,mutate]'
	touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	$(BIN)/python tests/mutate.py $(MODULES)

clean:
	rm -rf $(VENV) $(DEMO_DIR) packbench.db archives .mutate
