"""The checked-in stubs in src/specinfer/v1 are what scripts/gen_protos.py makes of protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO / "scripts/gen_protos.py"), "--out", str(tmp_path)], check=True, capture_output=True
    )
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "specinfer/v1").iterdir() if p.is_file()}
    checked_in = {p.name: p.read_bytes() for p in (REPO / "src/specinfer/v1").iterdir() if p.is_file()}
    stale = sorted(name for name in fresh.keys() | checked_in.keys() if fresh.get(name) != checked_in.get(name))
    assert not stale, f"stale generated stubs (run python scripts/gen_protos.py): {stale}"
