# Every target builds or reuses the local virtualenv .venv, so a fresh machine needs only
# Python 3.11+ (and no PostgreSQL: without a DSN flowly starts an embedded one).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-embedded lint bench bench-peers chaos clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/flowly demo

# pytest processes running the suite side by side (pytest-xdist; each has its own databases):
# most tests wait on workers, leases and frozen connections, so six keep two cores busy (the
# suite takes five to eight minutes on two); 0 runs it in this process alone. Tests that
# measure the server's shared notification queue run in one process (xdist_group, loadgroup)
TEST_WORKERS ?= 6

test: $(BIN)/.installed
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

# the same suite on the embedded PostgreSQL 18 (CI runs both), but for the packaging tests,
# which test the wheel, not the server
test-embedded: $(BIN)/.installed
	FLOWLY_TEST_EMBEDDED=1 FLOWLY_TEST_PG_VERSION=18 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup \
	    -m "not packaging"

lint: $(BIN)/.installed
	$(BIN)/ruff check flowly tests bench examples
	$(BIN)/mypy

# every figure of issue 11 in one sitting (peers included), one table of ratios; the full
# size takes 8 to 25 minutes (the machine's speed), CI (CI=true) or BENCH_ARGS="--size ci"
# about two
bench: $(BIN)/.peers
	$(BIN)/python bench/suite.py $(BENCH_ARGS)

$(BIN)/.peers: $(BIN)/.installed pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test,bench,peers]'
	touch $@

# flowly next to DBOS Transact, Absurd and pgqueuer on the same server, same workloads
bench-peers: $(BIN)/.peers
	$(BIN)/python bench/peers.py $(PEERS_ARGS)

# a mixed workload while workers are killed, frozen and disconnected and the server restarts,
# on an embedded PostgreSQL of its own; checks the guarantees (about a minute; longer:
# make chaos CHAOS_ARGS="--duration 600")
chaos: $(BIN)/.installed
	$(BIN)/python bench/chaos.py $(CHAOS_ARGS)

# stop the embedded servers (the project's and the test suite's) before deleting their data;
# without the venv, a fast shutdown by signal (what pg_ctl stop -m fast sends)
clean:
	@for pidfile in .flowly/*/postmaster.pid; do \
	    [ -f "$$pidfile" ] || continue; \
	    dir=$$(dirname "$$pidfile"); \
	    if [ -x $(BIN)/flowly ]; then $(BIN)/flowly embedded stop --data-dir "$$dir"; \
	    else pid=$$(head -1 "$$pidfile"); kill -INT "$$pid" 2>/dev/null && \
	        for i in $$(seq 100); do kill -0 "$$pid" 2>/dev/null || break; sleep 0.1; done; fi; \
	done
	rm -rf $(VENV) .flowly .pytest_cache .mypy_cache .ruff_cache
