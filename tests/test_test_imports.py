"""Tests share helpers through ``tests/support``, never by importing another test module or a conftest.

A helper defined in a test module and imported elsewhere ties two test files together: editing the one breaks the
other, pytest collects the helper's module twice over, and a reader of the importer looks for the helper among
tests. The rule is checked on the source with ``ast``, function-local imports included, and nothing is imported to
check it.
"""

from __future__ import annotations

import ast

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.unit


def shared_through_tests(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import of a test module (``test_*``) or of a conftest in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            last = name.split(".")[-1]
            if name.startswith("tests.") and (last.startswith("test_") or last == "conftest"):
                found.append((node.lineno, name))
    return found


def test_no_test_module_imports_another_test_module_or_a_conftest():
    broken = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line, module in shared_through_tests(path.read_text())
    ]
    assert broken == [], "move the shared helper into tests/support:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    "source",
    [
        "from tests.trainer.learning.test_learner import experience\n",
        "from tests.conftest import write_config\n",
        "def f():\n    from tests.deploy.conftest import load_yaml\n",
        "import tests.common.test_bus_faults\n",
    ],
    ids=["a test module", "the root conftest", "a conftest, inside a function", "a plain import"],
)
def test_an_import_of_a_test_module_or_a_conftest_is_caught(source):
    assert len(shared_through_tests(source)) == 1


def test_imports_of_the_support_package_and_helper_modules_pass():
    allowed = "from tests.support.runs import write_config\nfrom tests.trainer.simulation import run_scenario\n"
    assert shared_through_tests(allowed) == []
