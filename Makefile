# Developer entry points; every target installs the virtualenv first when needed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-slow corpus matrix frameworks soundness browser bench bench-scar docs clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-no-deps.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -e '.[test]'
	$(VENV)/bin/python -m pip install --no-deps -r requirements-no-deps.txt
	touch $@

demo: venv
	mkdir -p reports
	$(VENV)/bin/scalify verify configs/experiments/demo.yaml --json reports/demo.json --html reports/demo.html

# Two test processes (the CI machine's cores); tests that start a Ray cluster share one of them.
TEST_WORKERS ?= 2

test: venv
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not matrix"

# The tests of minutes each (marked `slow`: the fused-QKV training cells of the matrix, a
# planted bug in neuronx's fused QKV); run them before a release (CI leaves them out for its time).
test-slow: venv
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m slow

# The blind corpus (tests/corpus): each case checked on gloo processes, then verified; prints
# the table per style and step (ARGS=style/ or a case name to run some; CORPUS_DEADLINE=S for
# each case's proof deadline, past which what is not proved is unknown; CORPUS_JOBS=N cases at once).
CORPUS_DEADLINE ?= 300
CORPUS_JOBS ?= 1
corpus: venv
	mkdir -p reports
	$(VENV)/bin/python -m tests.corpus.gloo_check $(ARGS)
	$(VENV)/bin/python -m tests.corpus.verify_cases --json reports/corpus.json \
	  --deadline $(CORPUS_DEADLINE) --jobs $(CORPUS_JOBS) $(ARGS)

# Every parallelism x forward/backward cell, verified or caught, printed as a table (tests
# marked `matrix`; ARGS=--skip-slow leaves the cells of minutes out, as CI does).
matrix: venv
	$(VENV)/bin/python -m scalify.matrix --jobs $(TEST_WORKERS) $(ARGS)

# The real Megatron-Core and torchtitan x plan x forward/loss/training step (tests marked
# `matrix`, minutes each), verified or caught at the bug's line, printed as a table; CI runs it.
frameworks: venv
	$(VENV)/bin/python -m scalify.framework_matrix --jobs $(TEST_WORKERS)

# Mutation testing: bugs planted in the captured TP graphs of tiny Llama and GPT-2 (TP 2/4/8)
# must all be caught; prints one table per configuration (ARGS=--budget N to change its size).
soundness: venv
	mkdir -p reports
	$(VENV)/bin/python -m scalify.mutate.soundness --json reports/soundness.json $(ARGS)

# Debian's Chromium, for tests/report/test_html_browser.py; does nothing when it is installed.
browser:
	command -v chromium >/dev/null || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; }

bench: venv
	$(VENV)/bin/python benchmarks/run.py
	$(VENV)/bin/python benchmarks/neuronx.py

# SCAR fault tolerance: rework cost of each recovery strategy (about 2 minutes; ARGS=--quick
# for a short run). One BLAS thread: the iterations are small and the cores are shared.
bench-scar: venv
	OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 $(VENV)/bin/python benchmarks/scar.py $(ARGS)

# The documentation site (mkdocs.yml, docs/) built into site/; --strict fails on a broken link
# or a page missing from the nav. Needs only the docs extra's packages, not the project: the
# configuration reference is read from this checkout's scalify/config.py. NO_MKDOCS_2_WARNING
# hides Material's banner on every build (its end of life, May 2027, and Zensical, its successor).
DOCS_STAMP := $(VENV)/.docs-installed
DOCS_EXTRA := import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"])

$(DOCS_STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $$($(VENV)/bin/python -c '$(DOCS_EXTRA)')
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf reports build site .pytest_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
