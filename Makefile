# Every target creates or reuses the virtual environment .venv, so a fresh machine needs
# nothing but python3 (3.11+).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test test-fast bench lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	@touch $@

install: $(STAMP)

run: $(STAMP)
	$(BIN)/llm-epp-stack

test: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/pytest -m "not integration" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/llm-epp-bench all --out results

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
