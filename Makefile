# make demo: train the tiny GPT on the CPU, inject a failure, restart, recover.
# make test: the test suite.
# Both create .venv on first use; torch is pinned to the CPU wheel (an unpinned
# torch pulls several GB of CUDA packages).

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

export DS_ACCELERATOR ?= cpu
export PYTHONUNBUFFERED := 1

.PHONY: demo test clean .venv

.venv: $(STAMP)

$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,bench]' $(TORCH)
	touch $@

demo: $(STAMP)
	$(PY) launch/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf runs .pytest_cache
