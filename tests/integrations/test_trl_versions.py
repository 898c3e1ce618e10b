"""The TRL versions a user can keep: the `trl` extra of the built package metadata admits exactly the
versions the adapter's import check lets run (TRL 1.17.x included, with its warning), and the Makefile
still pins the tested version for CI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import warnings
from email.parser import Parser
from pathlib import Path

import pytest

pytest.importorskip("otbrl.integrations.trl")

from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

from otbrl.integrations.trl import ACCEPTED_TRL, TESTED_TRL, _check_trl_version  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = [
    "1.15.0",
    "1.15.9",
    "1.16.0rc1",
    "1.16.0",
    "1.16.3",
    "1.17.0",
    "1.17.2",
    "1.18.0",
    "1.99.1",
    "2.0.0.dev1",
    "2.0.0",
    "2.1.0",
]


@pytest.fixture(scope="module")
def trl_requirement(tmp_path_factory: pytest.TempPathFactory) -> Requirement:
    """The `trl` requirement of the `trl` extra, from metadata setuptools builds out of pyproject.toml (a
    copy with a stub package: the metadata does not depend on the code)."""
    src = tmp_path_factory.mktemp("meta")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    (src / "otbrl").mkdir()
    (src / "otbrl" / "__init__.py").write_text("")
    (src / "out").mkdir()
    code = "import sys\nfrom setuptools import build_meta\n"
    code += "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(src / "out")],
        cwd=src,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    info = done.stdout.strip().splitlines()[-1]
    metadata = Parser().parsestr((src / "out" / info / "METADATA").read_text())
    found = []
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name == "trl" and req.marker is not None and req.marker.evaluate({"extra": "trl"}):
            found.append(req)
    assert len(found) == 1, found
    return found[0]


def _accepted(version: str) -> tuple[bool, bool]:
    """(whether the adapter's import check lets `version` run, whether it warns)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _check_trl_version(version)
        except ImportError:
            return False, False
    return True, any(issubclass(w.category, UserWarning) for w in caught)


def test_the_trl_extra_admits_what_the_import_check_accepts(trl_requirement):
    admits = {v: trl_requirement.specifier.contains(v, prereleases=True) for v in VERSIONS}
    assert admits == {v: _accepted(v)[0] for v in VERSIONS}
    assert str(trl_requirement.specifier) == str(Requirement(f"trl{ACCEPTED_TRL}").specifier)
    assert admits["1.17.0"] and admits["1.17.2"] and admits["1.16.0"]
    assert not admits["1.15.9"] and not admits["2.0.0"]


def test_a_newer_minor_trl_runs_with_the_warning_and_the_tested_one_without():
    low, high = TESTED_TRL
    assert _accepted("1.17.0") == (True, True)
    assert _accepted("1.16.0") == (True, False)
    with pytest.warns(UserWarning, match=rf"tested with trl>={re.escape(low)},<{re.escape(high)}"):
        _check_trl_version("1.17.1")
    with pytest.raises(ImportError, match=r"needs trl>=1\.16,<2"):
        _check_trl_version("1.15.2")


def test_the_makefile_pins_the_tested_trl(trl_requirement):
    """CI installs the tested version, inside both the tested range and the extra."""
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.findall(r"\btrl==([0-9][0-9A-Za-z.]*)", makefile)
    assert pinned == ["1.16.0"]
    low, high = TESTED_TRL
    assert Version(low) <= Version(pinned[0]) < Version(high)
    assert trl_requirement.specifier.contains(pinned[0])
