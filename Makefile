PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eyas-installed
# speculators 0.9.0 pins transformers<=5.19, older than ours: the third-party interop test runs it from its own
# folder, put before .venv's site-packages on PYTHONPATH (torch, numpy, pandas, ... come from .venv; torch 2.13 meets
# its pin >=2.9,<=2.14.1). --no-deps with exactly what .venv lacks for speculators' model classes: no second torch.
SPECULATORS := .venv-tools/speculators
SPECULATORS_PKGS := speculators==0.9.0 transformers==5.19.0 datasets==5.1.0 hs-connectors==0.9.0 dill==0.4.1 \
	multiprocess==0.70.19 xxhash==4.1.0 loguru==0.7.3

.PHONY: setup tools test demo bench mlflow-ui clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	# torch first: the pinned CPU wheel lies on this disk; a bare `torch` would pull a CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

$(SPECULATORS)/.eyas-installed: $(STAMP) Makefile
	rm -rf $(SPECULATORS)
	$(BIN)/pip install --no-deps --target $(SPECULATORS) $(SPECULATORS_PKGS)
	touch $@

# EYAS_SPECULATORS_PYTHON set by the caller (a python with speculators 0.9.0) replaces the tool folder.
tools: $(if $(EYAS_SPECULATORS_PYTHON),,$(SPECULATORS)/.eyas-installed)

# Two pytest workers: the integration tests (tests/integration, one unit of work: one Ray, MLflow or Serve at a time,
# in file order) spend much of their time waiting on Ray's start-ups, and the unit tests fill that time on the
# other worker (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

test: setup tools
	$(BIN)/python -m pytest tests $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

demo: setup
	$(BIN)/python -m jobs.demo

bench: setup
	$(BIN)/python -m jobs.bench --suite humaneval,chat --num-prompts 8

mlflow-ui: setup
	@echo "MLflow UI: http://127.0.0.1:5000/#/experiments?workflowType=machine_learning (Model training view)"
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlruns.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) .venv-tools
