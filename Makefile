# Fresh clone -> `make test` or `make demo`. torch is installed first and pinned: an unpinned torch
# pulls several GB of CUDA packages.
PY      := .venv/bin/python
STAMP   := .venv/.installed
TORCH   := torch==2.13.0

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check otbrl tests benchmarks

test: $(STAMP) lint
	$(PY) -m pytest tests

demo: $(STAMP)
	.venv/bin/otbrl demo

bench: $(STAMP)
	$(PY) benchmarks/bench_advantages.py
	$(PY) benchmarks/bench_energy.py
	$(PY) benchmarks/bench_fused.py

clean:
	rm -rf .venv .pytest_cache .ruff_cache .hypothesis
