# Kestrel: set-up, serve and test on a fresh machine. Everything goes into .venv/.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; on a GPU host pass TORCH_SPEC='torch' (CUDA wheels).
TORCH_SPEC ?= torch==2.13.0
MODEL  := models/SmolLM2-135M-Instruct
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=

.PHONY: setup model serve test lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

model: setup
	$(VENV)/bin/kestrel fetch-model

serve: model
	$(VENV)/bin/kestrel serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: model lint
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# ruff and mypy over services/, shared/ and kernels/ (their config is in pyproject.toml), and the
# import layering check (no import cycle, no service importing another). Run by `make test`.
lint: setup
	$(VENV)/bin/ruff check services shared kernels
	$(VENV)/bin/mypy
	$(PY) scripts/check_imports.py

clean:
	rm -rf $(VENV) build *.egg-info
