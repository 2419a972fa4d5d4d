# simsearch: `make demo` runs the whole chain on the embedded glyph set; `make test` runs the tests.
# Both set up the machine first (Debian fonts, .venv) when needed.

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   ?= runs/demo

.PHONY: setup lock demo console test test-fast bench soak protos lint clean

$(STAMP): pyproject.toml requirements.lock scripts/setup.sh
	bash scripts/setup.sh
	touch $@

setup: $(STAMP)

# Re-pin every package at the newest versions pyproject.toml allows (docs/operations.md, "The lock").
lock:
	bash scripts/lock.sh
	$(MAKE) setup

demo: $(STAMP)
	$(PY) -m scripts.demo --out $(DEMO)

# After `make demo`: its index served over gRPC (50051) and HTTP, the web console at http://127.0.0.1:8080/
console: $(STAMP)
	$(PY) -m serving serve --index-root $(DEMO)/index --http-port 8080 --metrics-port none --log-format text

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	@for script in benchmarks/bench_*.py; do name=$$(basename $$script .py); echo "== $$name"; \
		$(PY) -m benchmarks.$$name || exit 1; done

# Issue 47's soak (slow, not in `make bench`): `serve --ray` at S = 4 on 224-px images for 15 minutes —
# mixed image, embedding and bad requests, half over HTTP, a reload every 20 s, 32 callers; exits 1 on
# an unexpected status or a serving process's memory growing (docs/benchmarks.md). SOAK_FLAGS adds to it.
soak: $(STAMP)
	$(PY) -m benchmarks.soak --ray --shards 4 --synthetic 20000 --minutes 15 --reload-every 20 --no-baseline $(SOAK_FLAGS)

protos: $(STAMP)
	PATH=$(VENV)/bin:$$PATH bash scripts/gen_protos.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs .pytest_cache
