PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Written by `make install`: `make test` and `make serve` install first on a fresh machine.
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# Where torch comes from: empty = pip's configured indexes; the Docker build passes PyTorch's CPU or
# CUDA index (https://download.pytorch.org/whl/cpu, .../cu128).
TORCH_INDEX ?=
# Extras of the project to install: [dev] for development and CI, empty in the Docker image.
EXTRAS ?= [dev]
CONFIG ?= training/configs/multi30k_de_en.toml
PORT ?= 8000

.PHONY: install test lint train serve clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned and installed first: an unpinned torch would pull the CUDA build (several GB).
install: $(BIN)/python
	$(BIN)/pip install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.$(EXTRAS)'
	touch $(STAMP)

$(STAMP): pyproject.toml
	$(MAKE) install

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

serve: $(STAMP)
	$(BIN)/uvicorn app.main:app --host 0.0.0.0 --port $(PORT) --loop asyncio --no-access-log

train:
	$(BIN)/python -m training.train --config $(CONFIG)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
