# One entry point. `make demo` and `make test` set everything up on a bare machine.
# Override the torch build with e.g.  make test TORCH_SPEC="torch==2.13.0"  or TORCH_SPEC=skip to keep your own.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ "$(TORCH_SPEC)" != "skip" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo_kill_resume.py --out demo_out

test: $(STAMP)
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_save.py

clean:
	rm -rf $(VENV) demo_out .pytest_cache
