PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eyas-installed

.PHONY: setup test demo bench mlflow-ui clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	# torch first: the pinned CPU wheel lies on this disk; a bare `torch` would pull a CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest tests

demo: setup
	$(BIN)/python -m jobs.demo

bench: setup
	$(BIN)/python -m jobs.bench

mlflow-ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlruns.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV)
