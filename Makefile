# Every target creates and fills its own virtual environment first, so each works on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VENV_CT8  := .venv-ct8
STAMP_CT8 := $(VENV_CT8)/.installed

.DEFAULT_GOAL := help
.PHONY: help venv lint demo test test-coremltools-8 bench bench-llm fuzz models coremltools-suite layernorm-shadow examples docs docs-images clean

help: ## List the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench,report,lint,docs]"
	touch $(STAMP)

venv: $(STAMP) ## Create .venv and install the project with its test, lint and docs extras

lint: $(STAMP) ## Check formatting, lint rules and types (ruff, mypy; configured in pyproject.toml)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

demo: $(STAMP) ## Convert a PyTorch pre-norm transformer with and without the override; show what fused
	$(PY) examples/demo.py

# The suite runs in 2 processes (pytest-xdist; processes, not threads: coremltools' builder is global);
# each worker builds the session's shared fixtures once for itself.
PYTEST_PARALLEL ?= -n 2

test: $(STAMP) ## Run the test suite (bounded fuzzing included), in 2 processes
	$(PY) -m pytest -q $(PYTEST_PARALLEL) tests

$(STAMP_CT8): pyproject.toml
	$(PYTHON) -m venv $(VENV_CT8)
	$(VENV_CT8)/bin/python -m pip install -q --upgrade pip
	$(VENV_CT8)/bin/python -m pip install -q -e ".[test,bench,report]" "coremltools==8.3.0"
	touch $(STAMP_CT8)

test-coremltools-8: $(STAMP_CT8) ## Run the test suite on coremltools 8.3, in its own environment (.venv-ct8)
	$(VENV_CT8)/bin/python -m pytest -q $(PYTEST_PARALLEL) tests

bench: $(STAMP) ## Benchmark against coremltools side by side; prints ratios, writes bench/out/scaling.png
	$(PY) -m bench

bench-llm: $(STAMP) ## Whole conversion at LLM size (10k-100k ops): override off, on (fusions), on+ (and cleanup replacements), pattern_infra.pipeline(); writes docs/llm_scaling.png
	$(PY) -m bench.llm

fuzz: $(STAMP) ## Long fuzzing: random programs through every generic pass, and against a brute-force matcher
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-20000} $(PY) -m pytest -q $(PYTEST_PARALLEL) tests/test_fuzz.py tests/test_brute_force.py -p no:cacheprovider --hypothesis-show-statistics

models: $(STAMP) ## Real-model tables (hand-written, transformers and vision zoos), then the slow zoo and stateful-decoder tests and the slow doc snippets
	$(PY) examples/real_models.py
	$(PY) examples/vision_models.py
	$(PY) -m pytest -q --run-slow tests/test_hf_models.py tests/test_real_models.py tests/test_vision_models.py tests/test_stateful.py tests/test_docs_snippets.py

coremltools-suite: $(STAMP) ## Run coremltools' own tests of the replaced passes against our passes
	$(PY) -m pytest -q tests/coremltools_suite

layernorm-shadow: $(STAMP) ## Layer-norm tests, coremltools' suite and model tables, each layer-norm run compared with the 112-sub-pass reference
	rm -f layernorm-shadow.log
	PATTERN_INFRA_SHADOW_LAYERNORM=$(CURDIR)/layernorm-shadow.log $(PY) -m pytest -q tests/passes/test_fuse_layernorm_or_instancenorm.py tests/coremltools_suite tests/test_real_models.py tests/test_hf_models.py
	sort layernorm-shadow.log | uniq -c

examples: $(STAMP) ## Run every example script
	@set -e; for f in examples/[0-9]*.py; do echo "== $$f"; $(PY) $$f; done

$(VENV)/.docs-installed: $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed ## Build the documentation site into site/ (mkdocs --strict: any warning, a broken link, fails); check its API page
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	DOCS_SITE=site $(PY) -m pytest -q -p no:cacheprovider tests/test_docs_api.py

docs-images: $(STAMP) ## Redraw docs/report.png from the current code (headless chromium); copy make bench's plot to docs/
	@command -v chromium >/dev/null || { echo "make docs-images needs chromium (apt-get install chromium)"; exit 1; }
	rm -rf build/docs-images && mkdir -p build/docs-images
	$(PY) examples/save_zoo_model.py prenorm_transformer build/docs-images/transformer.mlpackage
	$(VENV)/bin/mil-patterns report build/docs-images/transformer.mlpackage --html build/docs-images/report --no-progress
	chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
		--user-data-dir=$(CURDIR)/build/docs-images/profile --window-size=1100,1400 --hide-scrollbars \
		--screenshot=$(CURDIR)/docs/report.png file://$(CURDIR)/build/docs-images/report/index.html
	@if [ -f bench/out/scaling.png ]; then cp bench/out/scaling.png docs/scaling.png; echo "copied bench/out/scaling.png"; \
	else echo "docs/scaling.png unchanged: make bench writes bench/out/scaling.png"; fi
	@echo "docs/llm_scaling.png is written by make bench-llm itself"

clean: ## Remove the virtual environments, caches and built docs
	rm -rf $(VENV) $(VENV_CT8) .pytest_cache .hypothesis bench/out site build/docs-images
