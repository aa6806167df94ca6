"""The package as a user gets it: a wheel built from the tree, installed into a fresh virtual environment.

The fresh environment sees the test environment's packages (torch, DeepSpeed and Lightning are not
downloaded again) through a ``.pth`` file of plain paths: a ``.pth`` file's paths are added to
``sys.path`` but their own ``.pth`` files are not run, so an editable install of this repository there
is not visible. ``lightning_bamboo`` itself must come from the wheel; the test checks where it is imported from.
"""

from __future__ import annotations

import json
import re
import shutil
import site
from pathlib import Path

import pytest

import lightning_bamboo
from tests.helpers import PYTHON, REPO, run

pytestmark = pytest.mark.timeout(300)

# no PYTHONPATH pointing at a source tree; the commands run outside the repository
ISOLATED = {"PYTHONPATH": "", "PYTHONNOUSERSITE": "1"}


def test_version_is_pyprojects_single_source():
    text = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'version = {attr = "lightning_bamboo.__version__"}' in text
    assert re.fullmatch(r"\d+\.\d+\.\d+", lightning_bamboo.__version__)
    assert f"## {lightning_bamboo.__version__}" in (REPO / "CHANGELOG.md").read_text()
    assert "Apache License" in (REPO / "LICENSE").read_text()


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"  # a copy, so building leaves no build/ or egg-info in the repository
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "lightning_logs"))
    wheels = tmp / "wheels"
    built = run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(source)],
                timeout=180, cwd=tmp)
    assert built.returncode == 0, built.stdout[-3000:]
    (wheel,) = wheels.glob("lightning_bamboo-*.whl")
    assert wheel.name.startswith(f"lightning_bamboo-{lightning_bamboo.__version__}-")
    env = tmp / "venv"
    made = run([PYTHON, "-m", "venv", "--without-pip", str(env)], timeout=120, cwd=tmp)
    assert made.returncode == 0, made.stdout[-3000:]
    (purelib,) = env.glob("lib/python*/site-packages")
    (purelib / "test_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed = run([PYTHON, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "--no-deps", "--no-index",
                     "-q", str(wheel)], timeout=180, cwd=tmp, env=ISOLATED)
    assert installed.returncode == 0, installed.stdout[-3000:]
    return env


def test_wheel_installs_and_runs_the_command_and_a_demo(venv, tmp_path):
    where = run([str(venv / "bin" / "python"), "-c", "import json, lightning_bamboo as lb; "
                 "print(json.dumps([lb.__file__, lb.__version__]))"], timeout=120, cwd=tmp_path, env=ISOLATED)
    assert where.returncode == 0, where.stdout[-3000:]
    path, version = json.loads(where.stdout.strip().splitlines()[-1])
    assert Path(path).is_relative_to(venv) and not Path(path).is_relative_to(REPO), path
    assert version == lightning_bamboo.__version__
    assert (Path(path).parent / "data" / "aws-p3-trace.csv").exists()  # package data is in the wheel

    helped = run([str(venv / "bin" / "lightning-bamboo"), "--help"], timeout=120, cwd=tmp_path, env=ISOLATED)
    assert helped.returncode == 0 and all(c in helped.stdout for c in ("demo", "simulate", "fit", "plan")), helped.stdout

    report = tmp_path / "report.json"
    demo = run([str(venv / "bin" / "lightning-bamboo"), "demo", "--nodes", "2", "--steps", "4", "--preempt", "",
                "--quiet", "--report", str(report)], timeout=240, cwd=tmp_path, env=ISOLATED)
    assert demo.returncode == 0, demo.stdout[-4000:]
    assert json.loads(report.read_text())["steps_completed"] == 4
