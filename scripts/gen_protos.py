#!/usr/bin/env python3
"""Regenerate the Python stubs of protos/specinfer/v1/*.proto into src/specinfer/v1/.

python scripts/gen_protos.py            # write the stubs
python scripts/gen_protos.py --out DIR  # write them under DIR instead (the staleness test)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    files = sorted(PROTOS.glob("specinfer/v1/*.proto"))
    (out / "specinfer/v1").mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
    ]
    if protoc.main(args + [str(f.relative_to(PROTOS)) for f in files]) != 0:
        raise SystemExit("protoc failed")
    package = out / "specinfer/v1"
    init = package / "__init__.py"
    init.write_text('"""Generated gRPC/protobuf code of protos/specinfer/v1 (scripts/gen_protos.py); do not edit."""\n')
    return sorted(p for p in package.iterdir() if p.suffix in (".py", ".pyi"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "src")
    args = ap.parse_args()
    for p in generate(args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
