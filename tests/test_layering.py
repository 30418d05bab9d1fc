"""Dependencies point one way: ``services.common`` <- roles <- CLIs, and within common, base <- concerns <- runtime.

``common`` is what every process loads; if it imported a role or a CLI, a reward worker would
drag in the trainer's math (and torch), and an edit to the launcher could break every role.
A role imports no other role: what two roles share (the episode loop, the reward rules) lives in
``common``, so each role can be built, tested and deployed on its own.
Inside ``common``, each concern package imports only what lies below it:

- base: ``config``, ``registry``, ``files``, ``refusal``, ``sandbox`` and the generated ``pb`` stubs; they import
  nothing else of common;
- ``observe`` (telemetry, logs, events, trackers, hardware): base only;
- ``transport`` (bus, messages, weight sync, storage, NATS, live config, presence) and ``model`` (modeling,
  datasets, chat, evaluation, reward rules): base and observe, never each other;
- ``episodes`` (environments, the episode loop, turns, observations): base, observe and transport (it plays
  episodes against a remote environment and builds the groups the bus carries), not model;
- runtime (``service``, ``startup_checks``): any of them, since it starts a role.

``doctor`` and ``launcher`` are siblings: what both need lives in ``common``. The rules are
checked on the source with ``ast``, so a function-local import counts as much as a top-level
one, and nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.common import registry
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

SERVICES = ROOT / "services"
ROLES = ("trainer", "rollout", "reward", "reference")
SIBLINGS = ("services.cli.doctor", "services.cli.launch")
# What each part of services.common may import of common (the module docstring says why).
COMMON_IMPORTS = {
    "base": {"base"},
    "observe": {"base", "observe"},
    "transport": {"base", "observe", "transport"},
    "model": {"base", "observe", "model"},
    "episodes": {"base", "observe", "transport", "episodes"},
    "runtime": {"base", "observe", "transport", "model", "episodes", "runtime"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source``, relative ones resolved.

    ``from a import b`` counts as importing ``a.b`` where that is a module, else ``a``.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from services.cli import doctor` imports the module services.cli.doctor.
            found += [
                (node.lineno, f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
                for alias in node.names
            ]
    return sorted(set(found))


def layer(module: str) -> str | None:
    """common, role or cli for a module of services/; None for anything else (the stdlib, packages, tests)."""
    parts = module.split(".")
    if parts[0] != "services" or len(parts) < 2:
        return None
    if parts[1] == "common":
        return "common"
    if parts[1] in ROLES:
        return "role"
    return "cli"  # services.cli (the rlpipe app, launcher, doctor, verify, ...) and the tuner: run by people


def common_part(module: str) -> str:
    """The part of services.common a module belongs to: base, observe, transport, model, episodes or runtime."""
    parts = module.split(".")
    part = parts[2] if len(parts) > 2 else ""
    if part in ("observe", "transport", "model", "episodes"):
        return part
    return "runtime" if part in ("service", "startup_checks") else "base"


def violation(importer: str, imported: str) -> str | None:
    """Why ``importer`` must not import ``imported``, or None if it may."""
    importer_layer, imported_layer = layer(importer), layer(imported)
    if importer_layer is None or imported_layer is None:
        return None
    if importer_layer == "common" and imported_layer != "common":
        return f"common must not import a {imported_layer} module"
    if importer_layer == imported_layer == "common":
        importer_part, imported_part = common_part(importer), common_part(imported)
        if imported_part not in COMMON_IMPORTS[importer_part]:
            return f"common's {importer_part} must not import its {imported_part}"
    if importer_layer == "role" and imported_layer == "cli":
        return "a role must not import a CLI module"
    if importer_layer == imported_layer == "role" and importer.split(".")[1] != imported.split(".")[1]:
        return "a role must not import another role: what both need belongs in services/common"
    siblings = {name for name in SIBLINGS if importer.startswith(name) or imported.startswith(name)}
    if len(siblings) == 2:
        return "doctor and launcher must not import each other: what both need belongs in services/common"
    return None


def violations_in(path: Path, source: str) -> list[str]:
    module = module_name(path)
    return [
        f"{path.relative_to(ROOT)}:{line}: {module} imports {imported}: {why}"
        for line, imported in imported_modules(source, module, path.name == "__init__.py")
        if (why := violation(module, imported))
    ]


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        (
            "services/common/config.py",
            "def f():\n    from services.trainer.learning.algorithms import KL_ESTIMATORS\n",
            "services.trainer.learning.algorithms: common must not import a role module",
        ),
        (
            "services/common/service.py",
            "from services.cli.doctor.checks import startup_checks\n",
            "common must not import a cli",
        ),
        (
            "services/common/x.py",
            "from services.cli.launch import launcher\n",
            "imports services.cli.launch.launcher: common must not",
        ),
        ("services/common/x.py", "from .. import reward\n", "imports services.reward: common must not"),
        (
            "services/cli/doctor/checks.py",
            "from services.cli.launch.launcher import nats_server_binary\n",
            "must not import each other",
        ),
        ("services/cli/launch/launcher.py", "import services.cli.doctor.checks\n", "must not import each other"),
        ("services/reward/service.py", "from services.cli import app\n", "a role must not import a CLI module"),
        (
            "services/trainer/admin.py",
            "from ..cli.admin.commands import register\n",
            "a role must not import a CLI module",
        ),
        (
            "services/trainer/episode_eval.py",
            "from services.rollout.engines import HfEngine\n",
            "a role must not import another role",
        ),
        ("services/reference/service.py", "from ..reward import service\n", "a role must not import another role"),
        (
            "services/common/episodes/runner.py",
            "from services.common.model.modeling import load_model\n",
            "common's episodes must not import its model",
        ),
        (
            "services/common/observe/telemetry.py",
            "from services.common.transport.bus import Bus\n",
            "common's observe must not import its transport",
        ),
        ("services/common/model/chat.py", "from ..transport import storage\n", "common's model must not import its"),
        ("services/common/transport/bus.py", "from services.common.model import modeling\n", "transport must not"),
        ("services/common/config.py", "from services.common.observe.logs import log_event\n", "base must not"),
        ("services/common/observe/logs.py", "from services.common import service\n", "observe must not import its run"),
    ],
)
def test_the_checker_catches_each_kind_of_wrong_way_import(path, source, expected):
    found = violations_in(ROOT / path, source)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    ("path", "source"),
    [
        (
            "services/trainer/service.py",
            "from services.common.transport.bus import Bus\nfrom .checkpoint import Checkpoints\n",
        ),
        ("services/cli/launch/launcher.py", "from services.common.startup_checks.roles import startup_checks\n"),
        (
            "services/cli/app.py",
            "from services.cli.launch.launcher import run\nfrom services.cli.doctor.checks import diagnose\n",
        ),
        ("services/common/service.py", "from services.common import registry\nimport torch\n"),
        ("services/common/service.py", "from services.common.transport.bus import Bus\n"),
        ("services/common/model/datasets.py", "from services.common.observe.logs import log_event\n"),
        ("services/common/transport/bus.py", "from ..config import RunConfig\nfrom ..observe import telemetry\n"),
        ("services/trainer/episode_eval.py", "from services.common.episodes.runner import run_episodes\n"),
        ("services/trainer/learning/learner.py", "from services.trainer.learning import objective\n"),
    ],
)
def test_the_checker_allows_imports_that_point_the_right_way(path, source):
    assert violations_in(ROOT / path, source) == []


def test_no_module_imports_the_wrong_way():
    found = [line for path in sorted(SERVICES.rglob("*.py")) for line in violations_in(path, path.read_text())]
    assert found == [], "wrong-way imports:\n" + "\n".join(found)


def test_the_built_in_names_config_accepts_are_what_the_roles_register():
    # Config knows the built-ins without importing the roles; this keeps the two lists from drifting apart.
    from services.common.model import reward_rules as functions
    from services.trainer.learning import algorithms, corrections

    assert sorted(algorithms.ADVANTAGE_ESTIMATORS) == sorted(registry.ADVANTAGE_ESTIMATORS.builtin)
    assert sorted(corrections.OFF_POLICY_CORRECTIONS) == sorted(registry.OFF_POLICY_CORRECTIONS.builtin)
    assert sorted(algorithms.KL_ESTIMATORS) == sorted(registry.KL_ESTIMATORS.builtin)
    assert sorted(algorithms.AGGREGATIONS) == sorted(registry.AGGREGATIONS.builtin)
    assert sorted(functions.REWARD_FUNCTIONS) == sorted(registry.REWARD_FUNCTIONS.builtin)


def test_the_roles_register_into_the_tables_config_validates_against():
    # A user's @register_advantage("x") must make `train.algorithm: x` valid, so the roles' tables are common's.
    from services.common.model import reward_rules as functions
    from services.trainer.learning import algorithms, corrections

    assert algorithms.ADVANTAGE_ESTIMATORS is registry.ADVANTAGE_ESTIMATORS
    assert corrections.OFF_POLICY_CORRECTIONS is registry.OFF_POLICY_CORRECTIONS
    assert algorithms.KL_ESTIMATORS is registry.KL_ESTIMATORS
    assert algorithms.AGGREGATIONS is registry.AGGREGATIONS
    assert functions.REWARD_FUNCTIONS is registry.REWARD_FUNCTIONS
