# rollout-gateway: every target does its own setup.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_PY := $(CURDIR)/.venv-vllm/bin/python
# The vLLM venv runs the trainer and the TRL layer from the tree (gateway, testbed, trainer).
VLLM_PATH := $(CURDIR):$(CURDIR)/testbed

.PHONY: help venv vllm tools lint test test-fast test-container image demo bench bench-soak bench-ceiling bench-trl clean

help:
	@echo "make test   - install everything (gateway venv + vLLM venv) and run lint + all tests"
	@echo "make demo   - async LoRA GRPO through the gateway on 2 real vLLM replicas (~4 min)"
	@echo "make test-fast - unit + integration tests only (no real vLLM, no containers)"
	@echo "make image  - build the sidecar image as localhost/rollout-gateway:dev (podman)"
	@echo "make test-container - build the image (cached) and test it as a container"
	@echo "make bench  - run the benchmarks in bench/ and refresh bench/results/"
	@echo "make bench-soak    - 30 min soak + 15 min replica kill/restart (bench/results/soak.*)"
	@echo "make bench-ceiling - max sustained req/s vs vllm-router, with a py-spy profile (<= 15 min)"
	@echo "make bench-trl     - TRL AsyncGRPOTrainer: gateway vs 1 replica vs vllm-router (~15 min)"

$(STAMP): pyproject.toml testbed/pyproject.toml
	@command -v uv >/dev/null 2>&1 || $(PY) -m pip install -q uv
	uv venv -q --allow-existing --python $(PY) $(VENV)
	uv pip install -q --python $(BIN)/python -e ".[dev,bench]"
	@touch $(STAMP)

venv: $(STAMP)

vllm: venv
	bash scripts/install-vllm.sh

lint: venv
	$(BIN)/ruff check gateway testbed trainer tests bench
	$(BIN)/ruff format --check gateway testbed trainer tests bench
	$(BIN)/mypy

tools: venv
	bash tests/deploy/ensure_tools.sh $(BIN)/python

test-fast: venv tools
	$(BIN)/python -m pytest -m "not e2e" -q --ignore=tests/container

image:
	bash scripts/build-image.sh

test-container: venv
	$(BIN)/python -m pytest tests/container -q

# Three pytest runs: the fast layer, then each real-vLLM layer on its own, so that no more
# than two vLLM replicas share the 2 cores at any time.
test: venv vllm tools lint
	$(BIN)/python -m pytest -m "not e2e" -q --ignore=tests/container
	$(BIN)/python -m pytest tests/container -q
	GATEWAY_VLLM_PYTHON=$(VLLM_PY) $(BIN)/python -m pytest -m e2e tests/local -q
	GATEWAY_VLLM_PYTHON=$(VLLM_PY) $(BIN)/python -m pytest -m e2e tests/e2e -q
	PYTHONPATH=$(VLLM_PATH) $(VLLM_PY) -m pytest tests/trl -q -p no:cacheprovider
	PYTHONPATH=$(VLLM_PATH) $(VLLM_PY) -m pytest tests/trainer -q -p no:cacheprovider

demo: venv vllm
	$(BIN)/python -m rollout_testbed.demo

bench: venv
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/routing.py

bench-soak: venv
	$(BIN)/python bench/soak.py

bench-ceiling: venv
	$(BIN)/python bench/ceiling.py

# TRL's real AsyncGRPOTrainer: gateway over 2 replicas vs 1 replica direct vs vllm-router.
bench-trl: venv vllm
	PYTHONPATH=$(VLLM_PATH) $(VLLM_PY) bench/trl_side_by_side.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
