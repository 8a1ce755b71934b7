# Two commands: `make run` serves on 127.0.0.1:8000, `make test` passes the tests.
# Both build .venv from the pinned requirements first; nothing else is needed but python3.11 and make.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test bench loadtest soak lint dist clean

$(VENV)/.run-stamp: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

# The dev venv also holds the client from the working tree (editable), so tests, bench/ and soak/ import
# attention_client; built without isolation by the setuptools pinned in requirements-dev.txt.
$(VENV)/.dev-stamp: requirements.txt requirements-dev.txt client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation -e './client[loadtest]'
	touch $(VENV)/.run-stamp $@

# A terminal reads the plain access log better; ATTN_LOG_FORMAT=json make run gives the JSON lines deployments get.
run: $(VENV)/.run-stamp
	ATTN_LOG_FORMAT=$${ATTN_LOG_FORMAT:-plain} $(PY) -m service

test: lint
	$(PY) -m pytest

# N replicas of the service, one core each, on 127.0.0.1 at ports 8000, 8001, ...: make replicas N=2
# (the client spreads a long request over them: attention-client --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 ...).
.PHONY: replicas
N ?= 2
replicas: $(VENV)/.run-stamp
	$(PY) -m service.replicas $(N)

# Lint and format check (ruff), the layer contracts (import-linter) and the types (mypy, over the packages
# its files list): configured in pyproject.toml.
lint: $(VENV)/.dev-stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The headline set of benchmarks (python -m bench: textbook, compression, client_wire, small_requests; ~15 min),
# printed as the tables of bench/README.md; `python -m bench NAME` runs one scenario, `python -m bench -h` lists
# them. Not part of `make test`. OPENBLAS_CORETYPE/L2_SIZE, if the machine sets them, are unset for this command
# only (they slow a current numpy). small_requests needs wrk (apt-get install wrk).
bench: $(VENV)/.dev-stamp
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) -m bench

# This service against KServe, MLServer, LitServe, Ray Serve and BentoML, the same attention model on
# each, side by side in one run (~5 min): bench/out/peers.md. The native doors are called as users call
# them, with requests' default headers. Not part of `make test`. The peers' venvs are built on first use
# (PyPI, a few minutes) in .peers/, or $BENCH_PEERS_DIR if set.
.PHONY: bench-peers
bench-peers: $(VENV)/.dev-stamp
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) -m bench peers $(BENCH_PEERS_ARGS)

# Triton's perf_analyzer against `make run`'s server (shared memory allowed) at concurrency 1 to 4 for
# T=64, 256, 1024, binary tensors and system shared memory side by side, with the server's queue and
# compute times (a few minutes): bench/out/perf_analyzer.md. Not part of `make test`. perf_analyzer (the tritonclient 2.40.0
# wheel's binary) is fetched on first use into .perf-analyzer/, or $BENCH_PERF_ANALYZER_DIR if set;
# it needs Debian's libb64-0d, installed with apt-get if missing.
.PHONY: bench-perf-analyzer
bench-perf-analyzer: $(VENV)/.dev-stamp
	$(PY) -m bench perf_analyzer $(BENCH_PERF_ANALYZER_ARGS)

# The latency-limit sweep against a running server: make loadtest LOADTEST_ARGS="--url http://127.0.0.1:8000 --slo-ms 250".
# Its venv holds the load tester alone, installed as a user would (pip install './client[loadtest]'), rebuilt when
# the client changes.
LOADTEST_VENV := .venv-loadtest
$(LOADTEST_VENV)/.stamp: client/pyproject.toml $(shell find client/attention_client -name '*.py')
	$(PYTHON) -m venv $(LOADTEST_VENV)
	rm -rf client/build
	$(LOADTEST_VENV)/bin/pip install -q './client[loadtest]'
	touch $@

loadtest: $(LOADTEST_VENV)/.stamp
	$(LOADTEST_VENV)/bin/attention-loadtest $(LOADTEST_ARGS)

# The client's wheel and sdist (attention-client, with its [loadtest] extra) in dist/. The build's scratch
# (client/build) goes first: setuptools would put a module since removed from the sources into the wheel.
dist: $(VENV)/.dev-stamp
	rm -rf client/build
	$(PY) -m build --no-isolation --outdir dist client

# Mixed traffic against a server it starts on 127.0.0.1 (10 min by default; not part of `make test`, which
# runs a 50 s version): make soak SOAK_ARGS="--duration 1800"; --url/--pid soak a running server.
SOAK_ARGS ?= --duration 600
soak: $(VENV)/.dev-stamp
	$(PY) -m soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(LOADTEST_VENV) dist client/build client/*.egg-info .pytest_cache .hypothesis .ruff_cache .mypy_cache
