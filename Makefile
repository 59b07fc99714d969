# One entry point. `make demo` and `make test` set everything up on a bare machine.
# Override the torch build with e.g.  make test TORCH_SPEC="torch==2.13.0"  or TORCH_SPEC=skip to keep your own.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench clean

$(STAMP): pyproject.toml setup.py ckptstore/format/_planes.c
	@# libfuse3 + fusermount3 for the power-loss tests (tests/lazyfs.py); as root where apt-get exists, else
	@# those tests skip, saying why
	if [ -e /dev/fuse ] && ! command -v fusermount3 >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3) >/dev/null || echo "fuse3 not installed: power-loss tests will skip"; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ "$(TORCH_SPEC)" != "skip" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo_kill_resume.py --out demo_out

test: $(STAMP)
	$(PY) -m pytest -q -rs --durations=25 $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_save.py

clean:
	rm -rf $(VENV) demo_out .pytest_cache
