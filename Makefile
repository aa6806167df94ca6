# Set-up and everyday commands. `make demo` and `make test` install everything from nothing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-one check gpu-check bench bench-readme lint clean

install: $(STAMP)

# torch goes first and pinned: 2.13.0 is the CPU wheel on this machine; an unpinned torch
# would pull several GB of CUDA packages.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

# A 4-node local spot cluster on the embedded store: node2 is killed at step 6, node3 gets a
# 2-second notice at step 14; --verify then trains the same steps without preemptions and checks
# that the weights are equal.
demo: install
	$(VENV)/bin/lightning-bamboo demo --nodes 4 --steps 24 --step-delay 0.2 --verify

# The suite in two lanes (pytest-xdist: two files at a time, the longest first: tests/conftest.py), then the tests
# marked `serial` alone (timing-bound under a second lane's load). Both parts always run; either failing fails it.
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial"; lanes=$$?; \
	$(PY) -m pytest -q -m serial; alone=$$?; \
	test $$lanes -eq 0 && test $$alone -eq 0

# The same tests in one process, in pytest's order (slower: most tests wait on processes more than they compute).
test-one: install
	$(PY) -m pytest -q

# The fast tier for everyday work: the tests that run in one process (no job, launcher, etcd or namespace);
# `make test` runs these and every multi-process test.
CHECK := $(addprefix tests/,test_architecture.py test_audit.py test_corpus.py test_data.py test_failover_plan.py \
	test_fence.py test_fleet.py test_layer_rng.py test_layout.py test_machine_layout.py test_placement.py test_planner.py test_planner_cli.py \
	test_policy.py test_precision.py test_profile.py test_reconfigure_plan.py test_schedule.py test_sim.py \
	test_sim_cli.py test_sim_demo.py test_sim_inputs.py test_sim_successors.py test_splice.py test_gradient_exchange_group.py \
	test_session_protocol.py test_liveness.py test_reroute_step.py test_restart_stand_by.py test_ties.py test_before_after.py test_engine_program.py \
	test_store_values.py test_hostile_inputs.py test_trust_boundary.py test_fatal_pairs.py test_launcher_outcome.py)

check: install
	$(PY) -m pytest -q $(CHECK)

# The prepared GPU check (about 7 minutes on one GPU of a 16-core machine), on a machine with a CUDA GPU and the
# packages installed (PY=python3 to use them outside .venv): the CUDA tests, then benchmarks/gpu.py (the NCCL layer
# against torch's group, its buffers, aborts; a 2-stage GPT of 0.52B parameters a stage sharing the GPU in off, lazy
# and eager, through a kill and a freeze), raw output with the commit in benchmarks/results/gpu_check.txt, kept
# when the check fails (what it measured is worth keeping). Without CUDA its
# first command says so and stops make (non-zero); tests/test_gpu_check.py checks that, the arguments and the
# report format of benchmarks/gpu.py on CPU, in `make test`.
GPU_TESTS := tests/test_comm_process.py tests/test_placement.py tests/test_profile.py tests/test_strategy_mp.py \
	tests/test_runner.py

gpu-check:
	$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make gpu-check needs a CUDA GPU (torch sees none)')"
	$(PY) benchmarks/record.py gpu_check --keep-failed -- sh -c '$(PY) -m pytest -q -rA $(GPU_TESTS) -k "cuda or nccl or gpu"; \
		tests=$$?; $(PY) benchmarks/gpu.py; check=$$?; echo "CUDA tests: exit $$tests; benchmarks/gpu.py: exit $$check"; \
		[ $$tests = 0 ] && [ $$check = 0 ]'

# Every result the README's numbers table cites, recorded again from the command its file names (hours here).
bench: install
	$(PY) benchmarks/rerecord.py --all

bench-readme: install
	$(PY) benchmarks/rerecord.py --readme

lint: install
	$(VENV)/bin/ruff check lightning_bamboo tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
