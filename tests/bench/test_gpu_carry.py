"""bench/gpu_carry.py: the calls that carry the GPU benches fit the device tool's limits, and the device side puts
the GGUF back together only from intact parts, naming a machine that went cold between calls."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tarfile
from pathlib import Path

import pytest

from bench import gpu_carry
from bench.gpu_carry import CALL_LIMIT, MAX_CARRY_PATHS, MIB, Manifest, Part, plan_calls

pytestmark = pytest.mark.unit

GGUF_MIB = 94  # SmolLM2's Q4_1 file


def part_sizes(total_mib: int, part_mib: int) -> list[tuple[str, int]]:
    sizes, left = [], total_mib * MIB
    while left:
        sizes.append((f"build/carry/gguf/part-{len(sizes):02d}", min(part_mib * MIB, left)))
        left -= sizes[-1][1]
    return sizes


def test_every_call_stays_under_the_upload_limit_and_the_path_count_and_carries_every_part_once():
    tree = 7 * MIB
    first = [("build/carry/manifest.json", 8192), ("build/carry/wheels", 53 * MIB), ("models/tiny-long-tail", 2 * MIB)]
    parts = part_sizes(GGUF_MIB, 8)
    sizes = dict([*first, *parts])

    calls = plan_calls(tree, first, parts)

    for carried in calls:
        assert carried[0] == "build/carry/manifest.json"  # every call knows what it is part of
        assert tree + sum(sizes[path] for path in carried) <= CALL_LIMIT
        assert len(carried) <= MAX_CARRY_PATHS
    assert [path for carried in calls for path in carried if "/gguf/" in path] == [path for path, _ in parts]
    assert calls[0][:3] == [path for path, _ in first]
    assert len(calls) == 3  # 62 MiB in the first call leave no room for a part; 94 MiB of parts take two more


def test_a_first_call_or_a_part_too_large_for_any_call_is_refused_naming_it():
    with pytest.raises(ValueError, match="first call would carry"):
        plan_calls(10 * MIB, [("build/carry/manifest.json", 1), ("build/carry/wheels", 60 * MIB)], [])
    with pytest.raises(ValueError, match=r"part-00 .* does not fit"):
        plan_calls(10 * MIB, [("build/carry/manifest.json", 1)], part_sizes(60, 60))


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Manifest]:
    """A device-side checkout holding a manifest of three parts (none carried yet) and an empty stash."""
    root, stash = tmp_path / "checkout", tmp_path / "stash"
    monkeypatch.setattr(gpu_carry, "ROOT", root)
    monkeypatch.setattr(gpu_carry, "STASH", stash)
    data = [bytes([i]) * 1000 for i in range(3)]
    whole = b"".join(data)
    parts = [Part(f"part-{i:02d}", len(chunk), hashlib.sha256(chunk).hexdigest()) for i, chunk in enumerate(data)]
    manifest = Manifest("3.12", len(whole), hashlib.sha256(whole).hexdigest(), parts, wheels=[])
    (root / gpu_carry.PARTS).mkdir(parents=True)
    for part, chunk in zip(parts, data, strict=True):
        (tmp_path / part.name).write_bytes(chunk)  # what prepare wrote here, before a call carries it
    return tmp_path, manifest


def carry(tmp_path: Path, *names: str) -> None:
    for name in names:
        (gpu_carry.ROOT / gpu_carry.PARTS / name).write_bytes((tmp_path / name).read_bytes())


def test_parts_carried_over_several_calls_join_into_the_original_file(device: tuple[Path, Manifest]):
    tmp_path, manifest = device
    carry(tmp_path, "part-00")
    assert [part.name for part in gpu_carry.stash_parts(manifest)] == ["part-01", "part-02"]
    carry(tmp_path, "part-01", "part-02")
    assert gpu_carry.stash_parts(manifest) == []

    joined = tmp_path / "joined.gguf"
    gpu_carry.join_parts(manifest, joined)
    assert joined.read_bytes() == b"".join((tmp_path / part.name).read_bytes() for part in manifest.parts)


def test_a_damaged_part_is_refused_and_not_stashed(device: tuple[Path, Manifest]):
    tmp_path, manifest = device
    carry(tmp_path, "part-00")
    damaged = gpu_carry.ROOT / gpu_carry.PARTS / "part-00"
    damaged.write_bytes(b"\x01" + damaged.read_bytes()[1:])  # one byte changed on the way

    with pytest.raises(SystemExit, match="part-00 arrived damaged"):
        gpu_carry.stash_parts(manifest)
    assert not (gpu_carry.STASH / "part-00").exists()


def test_a_machine_that_went_cold_between_calls_is_named_rather_than_waited_on(device: tuple[Path, Manifest]):
    tmp_path, manifest = device
    carry(tmp_path, "part-00")
    gpu_carry.stash_parts(manifest)
    (gpu_carry.STASH / "part-00").unlink()  # /tmp emptied: the machine was handed back between calls
    carry(tmp_path, "part-01")

    with pytest.raises(SystemExit, match="part-00 from an earlier call are gone: the machine went cold"):
        gpu_carry.stash_parts(manifest)


def test_a_joined_file_that_differs_from_the_original_is_removed(device: tuple[Path, Manifest]):
    tmp_path, manifest = device
    carry(tmp_path, "part-00", "part-01", "part-02")
    gpu_carry.stash_parts(manifest)
    manifest.gguf_sha256 = "0" * 64  # parts intact, whole wrong: a stale manifest beside fresh parts

    joined = tmp_path / "joined.gguf"
    with pytest.raises(SystemExit, match="joined GGUF's SHA-256 differs"):
        gpu_carry.join_parts(manifest, joined)
    assert not joined.exists()


def test_the_carried_requirements_leave_the_images_torch_and_transformers_and_build_the_sdist_only_ones_apart():
    names = {gpu_carry.requirement_name(requirement) for requirement in gpu_carry.runtime_requirements()}

    assert not names & {"torch", "transformers", "nkeys"}  # the image's own; nkeys has no wheel to resolve
    assert {"nats-py", "pydantic", "grpcio-tools", "gguf", "trl", "nvidia-ml-py", "pynacl"} <= names  # nkeys's own


def test_a_device_call_refuses_wheels_for_another_python_and_names_a_missing_manifest(device, monkeypatch):
    _, manifest = device
    args = gpu_carry.argparse.Namespace(only="")
    with pytest.raises(SystemExit, match=r"no build/carry/manifest.json: .* start again from call 1"):
        gpu_carry.device(args)

    (gpu_carry.ROOT / gpu_carry.MANIFEST).write_text(json.dumps(dataclasses.asdict(manifest)))
    monkeypatch.setattr(gpu_carry.sys, "version_info", (3, 11, 7))
    with pytest.raises(SystemExit, match=r"the wheels are for Python 3.12, this is 3.11: run .*--python-version 3.11"):
        gpu_carry.device(args)


def test_what_comes_back_is_the_checks_output_and_one_archive_of_logs_rows_and_run_metrics(tmp_path, monkeypatch):
    check, root, out = tmp_path / "check", tmp_path / "checkout", tmp_path / "out"
    monkeypatch.setattr(gpu_carry, "CHECK_DIR", check)
    monkeypatch.setattr(gpu_carry, "ROOT", root)
    for name in (
        "logs/vs-trl-gpu.log",
        "runs/gpu-check-shared/metrics.jsonl",
        "runs/gpu-check-shared/logs/trainer.log",
        "runs/gpu-check-shared/checkpoints/step-10/model.safetensors",
    ):
        (check / name).parent.mkdir(parents=True, exist_ok=True)
        (check / name).write_text("x")
    bench = root / "build/bench"
    for name in ("vs_trl-smol.jsonl", "runs/bench-vs-trl-smol/metrics.jsonl", "trl-run-smol-t1/steps.jsonl"):
        (bench / name).parent.mkdir(parents=True, exist_ok=True)
        (bench / name).write_text("x")
    out.mkdir()

    (bench / "runs/bench-vs-trl-smol/logs").mkdir(parents=True)
    (bench / "runs/bench-vs-trl-smol/logs/rollout.log").write_bytes(b"x" * (gpu_carry.ARCHIVED_FILE_MAX + 1))

    gpu_carry.bring_back(out, since=0.0)

    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.tgz"]  # beside the check's own gpu-check.txt
    with tarfile.open(out / "gpu-check.tgz") as archive:
        names = {Path(name).name for name in archive.getnames()}
        left_out = archive.extractfile("left-out.txt").read().decode()
    assert {"vs-trl-gpu.log", "metrics.jsonl", "trainer.log", "vs_trl-smol.jsonl", "steps.jsonl"} <= names
    assert "model.safetensors" not in names  # checkpoints stay there
    assert "rollout.log" not in names and "rollout.log" in left_out  # too large to come back, and said so
