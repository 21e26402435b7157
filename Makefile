PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
CONFIG ?= training/configs/multi30k_de_en.toml

.PHONY: install test lint train clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned and installed first: an unpinned torch would pull the CUDA build (several GB).
install: $(BIN)/python
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev]'

test:
	$(BIN)/python -m pytest -q

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

train:
	$(BIN)/python -m training.train --config $(CONFIG)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
