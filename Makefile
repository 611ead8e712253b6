# Entry points a new user runs on a fresh machine: `make demo`, `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/slurm-etc plan --model llama-70b --from dp=16,tp=8,pp=8 --to dp=14,tp=8,pp=8 --distributed-optimizer

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/plan_scale.py
	$(BIN)/python bench/plan_quality.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
