"""forgepack's own packaging metadata builds without setuptools' deprecation warnings."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent

BUILD_METADATA = """
import sys, warnings
import setuptools.warnings
warnings.simplefilter("error", setuptools.warnings.SetuptoolsDeprecationWarning)
from setuptools import build_meta
print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))
"""


def test_the_license_is_an_spdx_string_and_setuptools_is_new_enough_for_it():
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in doc["build-system"]["requires"]  # PEP 639 license strings need 77


def test_metadata_builds_with_deprecation_warnings_as_errors(tmp_path):
    """The metadata of a copy of the project (pyproject, README, the package's marker) is prepared by
    the installed setuptools with its deprecation warnings turned into errors."""
    src = tmp_path / "src"
    (src / "forgepack").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    (src / "forgepack" / "__init__.py").write_text("")
    out = tmp_path / "meta"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", BUILD_METADATA, str(out)], cwd=src, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (info,) = out.glob("*.dist-info")
    metadata = (info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata
