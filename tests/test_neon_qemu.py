"""The ARM kernel families (neon-f32, neon-int16) run without ARM hardware: native/tests/neon_qemu.sh
builds the parity harness for AArch64 (static) and runs it under qemu-aarch64-static against float64
products of ggml's dequantised weights, next to their x86 counterparts (avx2-f32, avx2-int16) on the
same vectors; neon-int16 must give avx2-int16's results bit for bit.

Skipped only where the cross compiler or qemu is missing and cannot be installed (the script exits
77 then). About 20 s with the harnesses cached, 60-80 s on the first run after a change to a kernel
file (the x86 references take ~25 s each to compile on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# minutes each, not part of the default run: `python -m pytest -m qemu` (and .ci/run) run them
pytestmark = pytest.mark.qemu

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "native" / "tests"


def _run(script: str, timeout: int) -> tuple[str, str]:
    """Runs native/tests/SCRIPT; skips where it exits 77 (a tool missing that cannot be installed),
    else asserts it passed. Returns (stdout, stdout + stderr)."""
    proc = subprocess.run(["bash", str(SCRIPTS / script)], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    print(out)
    if proc.returncode == 77:
        reason = next((line for line in proc.stderr.splitlines() if "SKIP" in line), out.strip()[-300:])
        pytest.skip(reason)
    assert proc.returncode == 0, out[-12000:]
    return proc.stdout, out


def test_neon_family_under_qemu():
    stdout, out = _run("neon_qemu.sh", 600)
    lines = [line for line in stdout.splitlines() if "kernel_parity:" in line]
    assert any("kernel_parity: PASS: neon-f32" in line for line in lines), out[-12000:]
    # qemu's default CPU has the dot product: the integer family runs (not skipped)
    assert any("kernel_parity: PASS: neon-int16" in line for line in lines), out[-12000:]
    if os.uname().machine == "x86_64":
        for fam in ("avx2-f32", "avx2-int16"):
            assert any((f"kernel_parity: PASS: {fam}" in line or f"kernel_parity: SKIP: {fam}" in line)
                       for line in lines), out[-12000:]
        if "kernel_parity: PASS: avx2-int16" in stdout:  # the integer pair agrees bit for bit
            assert "neon-int16 and avx2-int16 results bit-identical" in stdout, out[-12000:]
    assert "neon_qemu: PASS" in stdout, out[-12000:]


def test_native_library_under_qemu():
    """The whole native library built for AArch64 (UBSan) and its C test run under qemu: the loader
    and its refusal of corrupt files, the pool, the policy and every ARM family on tiny split models
    (native/tests/native_qemu.sh; 5-6 minutes on 2 cores, a minute more the first time, when it
    builds libggml-base for AArch64 from the installed llama-cpp-python's sdist)."""
    if os.uname().machine != "x86_64":
        pytest.skip("the qemu run is for x86-64 hosts; on AArch64 run_sanitizers.sh runs test_native natively")
    stdout, out = _run("native_qemu.sh", 2400)
    # one line per model: "native_qemu: q6k (220s): PASS: ...; families generic,neon-f32,neon-int16; ..."
    runs = [line for line in stdout.splitlines() if line.startswith("native_qemu: ") and "): PASS: " in line]
    assert len(runs) == 2 and all("neon-int16" in line and "neon-f32" in line for line in runs), out[-12000:]
    assert "native_qemu: PASS" in stdout, out[-12000:]
