"""The install's package list: every folder of the package (code or data) is named, so setuptools installs it
without warning that a folder is absent from ``packages``."""

from __future__ import annotations

import os

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _folders(top: str, package: str) -> set[str]:
    found = set()
    for path, dirs, files in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if any(not f.endswith(".pyc") for f in files):
            rel = os.path.relpath(path, os.path.join(ROOT, top))
            found.add(package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}")
    return found


def test_every_package_folder_is_listed_with_its_data():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    expected = _folders("trinity_trl", "trinity_trl") | _folders("recipes", "trinity_trl.recipes")
    assert set(setuptools["packages"]) == expected
    for data in ("trinity_trl.recipes.configs", "trinity_trl.recipes.accelerate"):
        assert setuptools["package-data"][data] == ["*.yaml"]
