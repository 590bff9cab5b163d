# Two commands on a fresh machine: `make serve` (set up, build the tiny demo models, export a
# model repository, start tritonserver on 8000/8001/8002) and `make test` (the whole suite; CI).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EASEL := $(VENV)/bin/easel
STAMP := $(VENV)/.installed
PERF := $(VENV)/.perf-launcher
DEMO := demo/tiny
REPO := model_repository
AIPERF_VENV := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed
# `make serve OPENAI_PORT=8080` also serves the OpenAI images API on that port (easel openai).
OPENAI_PORT ?=

.PHONY: setup system-deps serve demo test clean aiperf bench-plots

setup: $(STAMP) $(PERF)

# perf_analyzer (tritonclient 2.50) links Debian's libb64; the Python backend stub links the
# system libpython of the running Python version.
# tritonserver's libraries, and a C compiler for the library easel serve preloads into it
# (clients/server_preload.py).
system-deps:
	@ldconfig -p | grep -q 'libb64.so.0d' && ldconfig -p | grep -q "libpython$$($(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")').so.1" && command -v cc >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq libb64-0d "libpython$$($(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" gcc libc6-dev; }

$(STAMP): requirements.txt pyproject.toml | system-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# .venv/bin/perf_analyzer as a launcher that finds the libcudart it links (clients/tools.py), so
# the load-testing command runs as written; re-run after pip reinstalls tritonclient.
$(PERF): $(STAMP) clients/tools.py
	$(PY) -m clients.tools perf-launcher
	touch $(PERF)

$(DEMO)/model_index.json: $(STAMP) $(PERF)
	rm -rf $(DEMO) && $(EASEL) tiny $(DEMO)

demo: $(DEMO)/model_index.json
	$(EASEL) export --model $(DEMO) --out $(REPO) --adapters $(DEMO)/adapters

serve: demo
	$(EASEL) serve --repo $(REPO)$(if $(OPENAI_PORT), --openai-port $(OPENAI_PORT))

# aiperf (NVIDIA's benchmark client; the tests drive its image-generation endpoint type) in a venv
# of its own: its dependencies would move huggingface_hub, numpy and pillow off the project's pins.
$(AIPERF_STAMP): requirements-aiperf.txt
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q -r requirements-aiperf.txt
	touch $(AIPERF_STAMP)

aiperf: $(AIPERF_STAMP)

test: setup aiperf
	$(PY) -m pytest -q

# The plots of every committed benchmark result folder, redrawn from its JSON.
bench-plots: $(STAMP)
	$(PY) -m clients.bench.report bench/results/*/

clean:
	rm -rf $(VENV) $(AIPERF_VENV) demo build
