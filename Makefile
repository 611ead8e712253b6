# Entry points a new user runs on a fresh machine: `make demo`, `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo plan-demo lint test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# The elastic demo: a small GPT through a grow, a preemption and a node loss on local
# processes, with the coordinator and its SQLite record (slurm-etc demo --help).
demo: $(STAMP)
	$(BIN)/slurm-etc demo

# A real-size plan: preemption takes the last two nodes of each of the 8 pipeline stages of
# a 1,024-GPU llama-70b job (dp 16 -> 14).
DROP := 14-15,30-31,46-47,62-63,78-79,94-95,110-111,126-127
plan-demo: $(STAMP)
	$(BIN)/slurm-etc plan --model llama-70b --from dp=16,tp=8,pp=8 --to dp=14,tp=8,pp=8 \
		--distributed-optimizer --drop-nodes $(DROP)

# Static checks first (configured in pyproject.toml): ruff over the code, tests and benchmarks;
# mypy over the package (strict on the pure core: plan/, alloc/, policy/).
lint: $(STAMP)
	$(BIN)/ruff check slurm_etc tests bench examples
	$(BIN)/mypy slurm_etc

# The tiers (tests/conftest.py): the multi-process modules that time something alone (they
# own both cores), then those that time nothing two at a time, then the Slurm tier in one
# process, in order (it mostly waits on real jobs), beside the unit tier and the lightest
# multi-process modules in the other.
test: lint
	$(BIN)/python -m pytest -q -m "not beside_slurm and not paired" tests/dist
	$(BIN)/python -m pytest -q -n 2 -m "paired" tests/dist
	$(BIN)/python -m pytest -q -n 2 -m "not dist or beside_slurm" tests/slurm tests/unit tests/dist

bench: $(STAMP)
	$(BIN)/python bench/plan_scale.py
	$(BIN)/python bench/plan_quality.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
