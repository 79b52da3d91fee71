"""The packages pyproject.toml lists are exactly the Python packages in the repository."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_every_package_is_installed():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {"": REPO / "src", **{k: REPO / v for k, v in cfg["package-dir"].items() if k}}
    found = set()
    for init in (REPO / "src").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(REPO / "src").parts))
    for name, folder in dirs.items():
        if name and (folder / "__init__.py").is_file():
            for init in folder.rglob("__init__.py"):
                found.add(".".join([name, *init.parent.relative_to(folder).parts]))
    assert found == set(cfg["packages"])
