PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
CONFIG ?= training/configs/multi30k_de_en.toml
PORT ?= 8000

.PHONY: install test lint train serve clean

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

serve: $(BIN)/uvicorn
	$(BIN)/uvicorn app.main:app --host 0.0.0.0 --port $(PORT)

$(BIN)/uvicorn:
	$(MAKE) install

train:
	$(BIN)/python -m training.train --config $(CONFIG)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
