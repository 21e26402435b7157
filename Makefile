PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Written by `make install`: `make test` and `make serve` install first on a fresh machine.
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# Where torch comes from: empty = pip's configured indexes; the Docker build passes PyTorch's CPU or
# CUDA index (https://download.pytorch.org/whl/cpu, .../cu128).
TORCH_INDEX ?=
# Extras of the project to install: [dev] for development and CI, empty in the Docker image and
# for `make serve`.
EXTRAS ?= [dev]
# Every package's version, as `make constraints` resolved them: what `make install`, CI and the
# Docker image install (torch apart: TORCH_VERSION, from TORCH_INDEX).
CONSTRAINTS := requirements/constraints.txt
CONFIG ?= training/configs/multi30k_de_en.toml
PORT ?= 8000

.PHONY: install test lint train serve clean constraints audit

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned and installed first: an unpinned torch would pull the CUDA build (several GB).
install: $(BIN)/python
	$(BIN)/pip install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.$(EXTRAS)'
	touch $(if $(EXTRAS),$(STAMP),$(SERVE_STAMP))

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(MAKE) install

# `make serve` on a fresh machine installs what serving needs, not the dev tools.
SERVE_STAMP := $(VENV)/.installed-serve
$(SERVE_STAMP): pyproject.toml $(CONSTRAINTS)
	$(MAKE) install EXTRAS=

# The constraints again, after a change of pyproject.toml's dependencies (or to take new releases):
# uv resolves every extra for Python 3.11 on x86-64 Linux, torch as the CPU build (its CUDA
# packages are not ours to pin; the CUDA image takes them from TORCH_INDEX with torch).
constraints: $(BIN)/python
	$(BIN)/pip install -q uv
	echo "torch==$(TORCH_VERSION)+cpu" > $(VENV)/torch-cpu.txt
	$(BIN)/uv pip compile pyproject.toml --extra dev --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --override $(VENV)/torch-cpu.txt --no-emit-package torch \
		--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match \
		--custom-compile-command "make constraints" --quiet -o $(CONSTRAINTS)

# The locked set against the known vulnerabilities (PyPI's advisory database; CI runs it).
# A database that answers slowly is bounded (AUDIT_TIMEOUT_S in all, 10 s a request): past it the
# set is reported not audited, as where the API is missing, instead of holding CI to its limit.
AUDIT_TIMEOUT_S ?= 300
audit: $(STAMP)
	timeout $(AUDIT_TIMEOUT_S) $(BIN)/pip-audit -r $(CONSTRAINTS) --no-deps --disable-pip \
		--progress-spinner off --timeout 10; status=$$?; \
	if [ $$status -eq 124 ]; then echo "pip-audit: no answer within $(AUDIT_TIMEOUT_S) s: not audited"; \
	else exit $$status; fi

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

serve: $(if $(wildcard $(STAMP)),$(STAMP),$(SERVE_STAMP))
	$(BIN)/uvicorn app.main:app --host 0.0.0.0 --port $(PORT) --http app.http.connections:GuardedHttp --loop asyncio --no-access-log

train:
	$(BIN)/python -m training.train --config $(CONFIG)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
