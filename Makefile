# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install varpack (CPU torch), run the main job on the embedded default
#   make test   - create .venv, install varpack + test deps, run the CPU test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch==2.13.0 is a local CPU build on the project machines (a plain `torch` would pull a multi-GB CUDA build).
# Elsewhere, PyTorch's CPU wheels: make demo TORCH_SPEC=torch TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=

.PHONY: venv demo test lint bench-planner bench-collate clean

# The stamp is rebuilt only when pyproject.toml changes, and then pip keeps every dependency already satisfied:
# an existing .venv keeps the versions it first resolved. A fresh clone (as .ci/run runs) or `make clean` tests
# the newest versions pyproject.toml allows; .ci/run prints the versions under test (.ci/versions.py).
$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/python -m pip install -q -e ".[test,bench,vision,gguf,lora,trl,logging]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/varpack demo

test: venv
	$(BIN)/python -m pytest -q tests

lint: venv
	$(BIN)/ruff check varpack tests benchmarks examples

bench-planner: venv
	$(BIN)/python benchmarks/planner.py

bench-collate: venv
	$(BIN)/python benchmarks/collate.py

clean:
	rm -rf $(VENV) build *.egg-info
