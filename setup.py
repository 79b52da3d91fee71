"""Which folder installs as which package: the packaging rule, written once (pyproject.toml holds the rest).

- ``src/specinfer/`` is ``specinfer``;
- ``kernels/`` is ``specinfer.kernels``;
- every folder ``services/<name>/`` with an ``__init__.py`` is ``specinfer.<name>``;
- subpackages follow their folders: below each of these roots, every folder with an ``__init__.py`` (reached
  through folders that have one) is a package, named by its path.

setuptools runs this file as ``__main__`` (``pip install .``, ``pip install -e .``, building a wheel). Tests and
scripts read the rule without running ``setup()``: ``runpy.run_path("setup.py")["package_dirs"]()``
(tests/test_packaging.py, tests/test_docs.py, scripts/gpu_layout.py).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """The top-level packages and their folders, relative to ``root``: ``{"specinfer": "src/specinfer",
    "specinfer.kernels": "kernels", "specinfer.<name>": "services/<name>", ...}``."""
    dirs = {"specinfer": "src/specinfer", "specinfer.kernels": "kernels"}
    for init in sorted(root.glob("services/*/__init__.py")):
        dirs[f"specinfer.{init.parent.name}"] = f"services/{init.parent.name}"
    return dirs


def packages(root: Path = ROOT) -> list[str]:
    """Every package the rule installs: each top-level package and the subpackages below its folder."""
    from setuptools import find_packages

    names = []
    for name, folder in package_dirs(root).items():
        names += [name, *(f"{name}.{sub}" for sub in find_packages(root / folder))]
    return names


if __name__ == "__main__":
    from setuptools import setup

    setup(package_dir=package_dirs(), packages=packages())
