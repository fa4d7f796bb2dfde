# make demo: train the tiny GPT on the CPU, inject a failure, restart, recover.
# make test: the test suite on TEST_WORKERS pytest-xdist workers (default 2, a test file each), then the tests
# marked serial (pytest.ini) alone: on 2 cores one worker takes about 16 minutes, two 11-13. The other job
# tests that kill a rank expect only what a loaded machine still guarantees (a checkpoint committed several
# iterations before the kill, the newest snapshot every rank holds).
# Both create .venv on first use; torch is pinned to the CPU wheel (an unpinned
# torch pulls several GB of CUDA packages).
# make test-fast: tests/unit alone (no process started, no sleep; under 90 s on 2 cores), the check after each step.
# make docs: the documentation site (mkdocs, docs/) into site/; make test builds it too, --strict, so a broken
# link or a config key without a description fails.
# make gpu-bench [GPU_OUT=DIR] [GPU_PART=1|2|3|quick|all]: every GPU measurement (benchmarks/gpu/run.sh), on the
# GPU machine, with the wheels of benchmarks/gpu/wheels.sh in .whl/ (it needs no .venv).

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
TEST_WORKERS ?= 2

export DS_ACCELERATOR ?= cpu
export PYTHONUNBUFFERED := 1
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test test-fast docs clean gpu-bench .venv

.venv: $(STAMP)

$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,bench,docs,hf]' $(TORCH)
	touch $@

demo: $(STAMP)
	$(PY) launch/demo.py

test: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet
ifeq ($(TEST_WORKERS),1)
	$(PY) -m pytest -q tests
else
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" tests
	$(PY) -m pytest -q -m serial tests
endif

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests/unit

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

GPU_OUT  ?= benchmarks/results/gpu
GPU_PART ?= all

gpu-bench:
	benchmarks/gpu/run.sh $(GPU_OUT) --part $(GPU_PART)

clean:
	rm -rf runs .pytest_cache site
