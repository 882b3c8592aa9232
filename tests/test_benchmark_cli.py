"""The benchmarks' command lines: a bad codec spec is a one-line error before any run starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("topk@bogus", "bad suffix @bogus; suffixes are"),
        ("topk@dx", "bad suffix @dx"),
        ("topk@d2", "wire.topk_density must be in (0, 1]"),
        ("topk@noef@carry", "wire.feedback_in_model keeps the error-feedback residual in the model: it needs error feedback"),
        ("int9", "unknown codec 'int9'"),
    ],
)
def test_convergence_refuses_a_bad_codec_spec(spec, message):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--methods", "", "--codecs", spec],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"convergence: error: --codecs {spec}: ") and message in last, run.stderr[-500:]
