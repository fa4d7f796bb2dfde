# make demo: train the tiny GPT on the CPU, inject a failure, restart, recover.
# make test: the test suite, a test file per worker on TEST_WORKERS (2) processes: its jobs wait on
# process starts, sockets and disks as much as they compute, so two workers on 2 cores take 11 minutes
# where one took 16.
# Both create .venv on first use; torch is pinned to the CPU wheel (an unpinned
# torch pulls several GB of CUDA packages).
# make gpu-bench [GPU_OUT=DIR] [GPU_PART=1|2|3|all]: every GPU measurement (benchmarks/gpu/run.sh), on the
# GPU machine, with the wheels of benchmarks/gpu/wheels.sh in .whl/ (it needs no .venv).

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
TEST_WORKERS ?= 2

export DS_ACCELERATOR ?= cpu
export PYTHONUNBUFFERED := 1

.PHONY: demo test clean gpu-bench .venv

.venv: $(STAMP)

$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,bench]' $(TORCH)
	touch $@

demo: $(STAMP)
	$(PY) launch/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

GPU_OUT  ?= benchmarks/results/gpu
GPU_PART ?= all

gpu-bench:
	benchmarks/gpu/run.sh $(GPU_OUT) --part $(GPU_PART)

clean:
	rm -rf runs .pytest_cache
