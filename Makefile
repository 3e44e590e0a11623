# ssdtrain developer tasks. Everything runs inside ./.venv, created on demand.
#
#   make test [PYTEST_ARGS="-k equivalence -x"]
#   make demo | make bench | make clean | make distclean
#
# torch is installed first and only if the venv cannot import it, so a torch
# you put in .venv yourself (e.g. a CUDA build) is kept. Override the default
# with TORCH_SPEC / TORCH_PIP_ARGS, e.g.
#   make test TORCH_SPEC=torch==2.4.1 TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

PYTHON         ?= python3
VENV           ?= .venv
TORCH_SPEC     ?= torch==2.13.0
TORCH_PIP_ARGS ?=
EXTRAS         ?= test,bench
PYTEST_ARGS    ?=

VPY   := $(VENV)/bin/python
PIP   := $(VPY) -m pip
STAMP := $(VENV)/.ssdtrain-installed

.DEFAULT_GOAL := test
.DELETE_ON_ERROR:
.PHONY: venv test demo bench clean distclean

# Reinstall when packaging metadata changes. (When csrc/ lands, add its
# sources here too so the native extension is rebuilt.)
$(STAMP): setup.py pyproject.toml
	@if [ ! -x "$(VPY)" ]; then \
		echo "==> creating $(VENV) with $(PYTHON)"; \
		$(PYTHON) -m venv $(VENV) || exit 1; \
	fi
	@if $(VPY) -c "import torch" >/dev/null 2>&1; then \
		echo "==> keeping installed torch $$($(VPY) -c 'import torch; print(torch.__version__)' 2>/dev/null)"; \
	else \
		echo "==> installing $(TORCH_SPEC)"; \
		$(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)" || exit 1; \
	fi
	@echo "==> installing ssdtrain (editable) with extras [$(EXTRAS)]"
	@$(PIP) install -q -e ".[$(EXTRAS)]"
	@touch $@

venv: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest tests $(PYTEST_ARGS)

demo: $(STAMP)
	$(VPY) examples/quickstart.py

bench: $(STAMP)
	$(VPY) benchmarks/step_overhead.py

# Build outputs only; the venv and benchmark results are kept. The stamp goes
# too, because removing in-place build products (e.g. ssdtrain/_C*.so) breaks
# the editable install until it is redone.
clean:
	rm -rf build dist *.egg-info .eggs .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o \( -name '*.so' -o -name '*.py[co]' \) -type f -exec rm -f {} +
	rm -f $(STAMP)

distclean: clean
	rm -rf $(VENV)
