"""The distribution installs everything under `expertcache.*` and nothing at the top level."""

import subprocess
import sys
import zipfile

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow  # builds a wheel and starts the CLI in subprocesses (`make test-fast` skips)


def test_bare_area_names_are_not_importable_outside_the_repo(tmp_path):
    for name in ("trainer", "telemetry", "runtime", "evals", "recipes"):
        r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode != 0 and "No module named" in r.stderr, (name, r.stderr)
    r = subprocess.run([sys.executable, "-c", "import expertcache.trainer.corpus, expertcache.telemetry, "
                        "expertcache.runtime, expertcache.evals, expertcache.recipes.cli"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_wheel_holds_only_the_namespace_and_imports(tmp_path):
    """`pip install .` path: build the wheel, check its files, import from it alone."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(REPO)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (whl,) = tmp_path.glob("expertcache-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"expertcache", whl.name.split("-")[0] + "-" + whl.name.split("-")[1] + ".dist-info"}, top
    for area in ("trainer", "telemetry", "runtime", "evals", "recipes"):
        assert f"expertcache/{area}/__init__.py" in names
    assert "expertcache/recipes/smoke.yaml" in names
    assert not any(n.startswith(("tests/", "scripts/")) for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    code = ("import sys; sys.path = [p for p in sys.path if 'expertcache' not in p and '__editable__' not in p]; "
            "import expertcache.trainer.corpus as c; print(c.__file__)")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": f"{site}:" + ":".join(p for p in sys.path if "site-packages" in p)})
    assert r.returncode == 0, r.stderr
    assert str(site) in r.stdout


def test_cli_help_lists_subcommands():
    r = subprocess.run([sys.executable, "-m", "expertcache.recipes.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for cmd in ("data", "pretrain", "quickstart", "train-cache-aware"):
        assert cmd in r.stdout
