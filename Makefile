# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= examples/arith-grpo.yaml

.PHONY: install demo test model bench clean

# The images run the same script (deploy/Dockerfile), so every environment installs alike.
# kubectl (kustomize) is for tests/deploy only, so it stays out of the images.
$(STAMP): pyproject.toml requirements.lock deploy/install-python.sh deploy/install-kubectl.sh
	PYTHON=$(PYTHON) sh deploy/install-python.sh $(VENV) vllm,test
	sh deploy/install-kubectl.sh build/tools/bin
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/rlpipe build-tiny --out models/tiny-arith --data data/arith --seed 0

# A demo starts over each time: --overwrite deletes the previous demo run (rlpipe run alone refuses to).
demo: model
	$(BIN)/rlpipe run $(CONFIG) --overwrite

# Lint and format first: they take seconds, the tests many minutes.
test: $(STAMP)
	$(BIN)/ruff check services tests bench
	$(BIN)/ruff format --check services tests bench
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python -m bench.weight_sync
	$(BIN)/python -m bench.telemetry
	$(BIN)/python -m bench.recovery

clean:
	rm -rf runs models data $(VENV)
