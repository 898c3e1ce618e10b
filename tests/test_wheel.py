"""What a user gets from `pip install otbrl`: the wheel built from this checkout holds every file of the
package (experiments, recipes, shipped checkpoints), and its commands work from an unrelated directory
(an editable install would hide anything missing). Offline: the wheel is built with this environment's
setuptools and installed with --no-deps into a folder of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("otbrl.integrations.trl")

ROOT = Path(__file__).resolve().parents[1]


def package_files() -> set[str]:
    """Every file of the otbrl package in this checkout, relative to the repository root."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "otbrl").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(wheel, site folder the wheel is installed into)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "otbrl", src / "otbrl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, timeout=600)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("otbrl-*.whl")
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=600)
    return wheel, site


def otbrl(site: Path, cwd: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """The installed `otbrl` script, run from `cwd` with the installed package first on the path."""
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "OTBRL_CACHE": str(cwd / "cache")}
    return subprocess.run([str(site / "bin" / "otbrl"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_the_wheel_holds_every_file_of_the_package(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        inside = set(z.namelist())
    missing = sorted(package_files() - inside)
    assert not missing, f"not in the wheel: {missing}"
    for folder in ("otbrl/app/experiments/", "otbrl/app/recipes/", "otbrl/app/checkpoints/"):
        assert any(n.startswith(folder) for n in inside), folder


def test_installed_commands_work_from_an_unrelated_directory(installed, tmp_path):
    _, site = installed
    where = otbrl(site, tmp_path, "recipes")
    assert where.returncode == 0 and "gsm8k-qwen2.5-0.5b" in where.stdout.split()
    # Nothing to summarise here yet: a clear line, no traceback.
    empty = otbrl(site, tmp_path, "claims")
    assert empty.returncode == 2 and "Traceback" not in empty.stderr
    assert empty.stderr.strip().startswith("otbrl: nothing to summarise: no study results")
    # The quick walk comparison: the packaged experiment, recipe and warm-start checkpoint.
    quick = otbrl(site, tmp_path, "compare", "walk", "--quick", "--jobs", "2")
    assert quick.returncode == 0, (quick.stdout[-2000:], quick.stderr[-2000:])
    results = tmp_path / "runs" / "compare-quick" / "results"
    assert (results / "walk.md").is_file() and (results / "walk.json").is_file()
    claims = otbrl(site, tmp_path, "claims", "--results", str(results))
    assert claims.returncode == 0, claims.stderr[-2000:]
    assert (results / "claims.md").is_file() and "Not run yet" in (results / "claims.md").read_text()
    # The commands ran the installed copy, not this checkout.
    code = "import otbrl; print(otbrl.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                           text=True)  # fmt: skip
    assert probe.stdout.strip() == str(site / "otbrl" / "__init__.py")
