# Every target creates and fills its own virtual environment first, so each works on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VENV_CT8  := .venv-ct8
STAMP_CT8 := $(VENV_CT8)/.installed

.DEFAULT_GOAL := help
.PHONY: help venv demo test test-coremltools-8 bench bench-llm fuzz models coremltools-suite layernorm-shadow examples clean

help: ## List the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench,report]"
	touch $(STAMP)

venv: $(STAMP) ## Create .venv and install the project with its test extras

demo: $(STAMP) ## Convert a PyTorch pre-norm transformer with and without the override; show what fused
	$(PY) examples/demo.py

test: $(STAMP) ## Run the test suite (bounded fuzzing included)
	$(PY) -m pytest -q tests

$(STAMP_CT8): pyproject.toml
	$(PYTHON) -m venv $(VENV_CT8)
	$(VENV_CT8)/bin/python -m pip install -q --upgrade pip
	$(VENV_CT8)/bin/python -m pip install -q -e ".[test,bench,report]" "coremltools==8.3.0"
	touch $(STAMP_CT8)

test-coremltools-8: $(STAMP_CT8) ## Run the test suite on coremltools 8.3, in its own environment (.venv-ct8)
	$(VENV_CT8)/bin/python -m pytest -q tests

bench: $(STAMP) ## Benchmark against coremltools side by side; prints ratios, writes bench/out/scaling.png
	$(PY) -m bench

bench-llm: $(STAMP) ## Whole conversion at LLM size (10k-100k ops): override off, on (fusions), on+ (and cleanup replacements), pattern_infra.pipeline(); writes docs/llm_scaling.png
	$(PY) -m bench.llm

fuzz: $(STAMP) ## Long fuzzing: random programs through every generic pass, and against a brute-force matcher
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-20000} $(PY) -m pytest -q tests/test_fuzz.py tests/test_brute_force.py -p no:cacheprovider --hypothesis-show-statistics

models: $(STAMP) ## Real-model tables (hand-written and transformers zoos), then the slow zoo tests
	$(PY) examples/real_models.py
	$(PY) -m pytest -q --run-slow tests/test_hf_models.py tests/test_real_models.py

coremltools-suite: $(STAMP) ## Run coremltools' own tests of the replaced passes against our passes
	$(PY) -m pytest -q tests/coremltools_suite

layernorm-shadow: $(STAMP) ## Layer-norm tests, coremltools' suite and model tables, each layer-norm run compared with the 112-sub-pass reference
	rm -f layernorm-shadow.log
	PATTERN_INFRA_SHADOW_LAYERNORM=$(CURDIR)/layernorm-shadow.log $(PY) -m pytest -q tests/passes/test_fuse_layernorm_or_instancenorm.py tests/coremltools_suite tests/test_real_models.py tests/test_hf_models.py
	sort layernorm-shadow.log | uniq -c

examples: $(STAMP) ## Run every example script
	@set -e; for f in examples/[0-9]*.py; do echo "== $$f"; $(PY) $$f; done

clean: ## Remove the virtual environments and caches
	rm -rf $(VENV) $(VENV_CT8) .pytest_cache .hypothesis bench/out
