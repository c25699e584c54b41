"""The ARM kernel family (neon-f32) run without ARM hardware: native/tests/neon_qemu.sh builds the
parity harness for AArch64 (static) and runs it under qemu-aarch64-static against float64 products
of ggml's dequantised weights, next to the x86 avx2-f32 family on the same vectors.

Skipped only where the cross compiler or qemu is missing and cannot be installed (the script exits
77 then). About 10 s with the harnesses cached, 30-60 s on the first run after a change to a kernel
file (the x86 reference takes ~25 s to compile on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "native" / "tests" / "neon_qemu.sh"


def test_neon_family_under_qemu():
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    print(out)
    if proc.returncode == 77:
        reason = next((line for line in proc.stderr.splitlines() if "SKIP" in line), out.strip()[-300:])
        pytest.skip(reason)
    assert proc.returncode == 0, out[-12000:]
    lines = [line for line in proc.stdout.splitlines() if "kernel_parity:" in line]
    assert any("kernel_parity: PASS: neon-f32" in line for line in lines), out[-12000:]
    if os.uname().machine == "x86_64":
        assert any(("kernel_parity: PASS: avx2-f32" in line or "kernel_parity: SKIP: avx2-f32" in line)
                   for line in lines), out[-12000:]
    assert "neon_qemu: PASS" in proc.stdout, out[-12000:]
