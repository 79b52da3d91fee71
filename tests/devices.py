"""The device the model tests put their models on: ``SPECINFER_TEST_DEVICE`` (default ``cpu``), e.g.
``cuda`` on a GPU machine (scripts/gpu_check.sh sets it). transformers, the oracle, stays on the CPU in
float32; only our models move."""

from __future__ import annotations

import dataclasses
import os

from specinfer.models.native import NativeOptions

TEST_DEVICE = os.environ.get("SPECINFER_TEST_DEVICE", "cpu")


def on_test_device(options: NativeOptions) -> NativeOptions:
    """``options`` on :data:`TEST_DEVICE`. The CPU tests pick ``attention="torch"`` to keep the
    Triton interpreter out of the model tests; on a GPU the kernel is what runs (``auto``)."""
    if TEST_DEVICE == "cpu":
        return options
    return dataclasses.replace(
        options, device=TEST_DEVICE, attention="auto" if options.attention == "torch" else options.attention
    )
