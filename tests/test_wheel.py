"""What a user gets from `pip install otbrl`: the wheel built from this checkout holds every file of the
package (recipes, shipped checkpoints) and nothing of the evidence suite (experiments, protocols, claims,
scipy), and its commands work from an unrelated directory
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
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
        check=True,
        timeout=600,
    )
    (wheel,) = (tmp / "dist").glob("otbrl-*.whl")
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=600)
    return wheel, site


def otbrl(site: Path, cwd: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """The installed `otbrl` script, run from `cwd` with the installed package first on the path."""
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "OTBRL_CACHE": str(cwd / "cache")}
    return subprocess.run(
        [str(site / "bin" / "otbrl"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_wheel_holds_every_file_of_the_package(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        inside = set(z.namelist())
        (meta,) = [n for n in inside if n.endswith(".dist-info/METADATA")]
        requires = [line for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]
    missing = sorted(package_files() - inside)
    assert not missing, f"not in the wheel: {missing}"
    for folder in ("otbrl/app/recipes/", "otbrl/tasks/checkpoints/"):
        assert any(n.startswith(folder) for n in inside), folder
    # The evidence suite stays in the repository: no experiment, protocol or claims code, and no scipy.
    suite = [
        n
        for n in inside
        if n.startswith("studies/") or n.endswith(("claims.py", "protocol.json")) or "/experiments/" in n
    ]
    assert not suite, suite
    assert requires and not [r for r in requires if "scipy" in r], requires


def test_installed_commands_work_from_an_unrelated_directory(installed, tmp_path):
    _, site = installed
    where = otbrl(site, tmp_path, "recipes")
    assert where.returncode == 0 and "gsm8k-qwen2.5-0.5b" in where.stdout.split()
    # The user's own comparison, on the packaged demo recipe and its shipped warm-start checkpoint.
    fast = [
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "8",
        "--num_generations",
        "4",
        "--eval_size",
        "8",
        "--train_size",
        "64",
        "--save_strategy",
        "no",
        "--report_to",
        "[]",
        "--threads",
        "1",
        "--disable_tqdm",
        "true",
    ]
    quick = otbrl(
        site, tmp_path, "compare", "--config", "demo", "--arms", "otb,grpo", "--seeds", "0,1", *fast
    )
    assert quick.returncode == 0, (quick.stdout[-2000:], quick.stderr[-2000:])
    page = tmp_path / "runs" / "compare-demo" / "compare.md"
    assert page.is_file() and (page.parent / "compare.png").is_file()
    assert "| grpo | 2 |" in page.read_text() and "[95% CI]" in page.read_text()
    # The suite's subcommands are not the package's.
    gone = otbrl(site, tmp_path, "claims")
    assert gone.returncode == 2 and "invalid choice: 'claims'" in gone.stderr
    # The commands ran the installed copy, not this checkout.
    code = "import otbrl; print(otbrl.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert probe.stdout.strip() == str(site / "otbrl" / "__init__.py")
