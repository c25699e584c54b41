"""Windows x86-64 without a Windows machine: native/tests/cross_build.sh --target windows builds the
native library with MinGW-w64 gcc exactly as bitsplit_llama.native.build links it on Windows, checks its
exports and imports, and loads it under wine (CPU detection, the kernel policy, each family's multiply
step as Windows code); native/tests/wine_parity.sh builds the kernel parity harness with every x86
family for Linux and for Windows and requires each family this CPU runs to give bit-identical results
on both, under wine.

Skipped only where MinGW-w64 or wine is missing and cannot be installed (the scripts exit 77 then).
A minute or two with the builds cached, 3-4 minutes on 2 cores after a change to a kernel file."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

# minutes each, not part of the default run: `python -m pytest -m wine` (and .ci/run) run them
pytestmark = [pytest.mark.wine,
              pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")]

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "native" / "tests"


def _run(*args: str, timeout: int) -> str:
    proc = subprocess.run(["bash", *[str(a) for a in args]], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    print(out)
    if proc.returncode == 77:
        pytest.skip(next((line for line in proc.stderr.splitlines() if "SKIP" in line), out.strip()[-300:]))
    assert proc.returncode == 0, out[-12000:]
    return proc.stdout


def test_cross_build_for_windows_loads_under_wine():
    out = _run(SCRIPTS / "cross_build.sh", "--target", "windows", timeout=900)
    assert "cross_build: PASS: native/ builds for Windows x86-64" in out, out
    # it was loaded and run, not only linked (wine is installed where the script could install it)
    smoke = next((line for line in out.splitlines() if line.startswith("win_smoke: ")), "")
    assert smoke.startswith("win_smoke: PASS: "), out
    from bitsplit_llama.native import policy

    # the Windows build's policy lists what the Linux build's lists on this CPU
    for fam in policy.families():
        assert f"{fam} " in smoke, (fam, smoke)


def test_kernel_families_bit_identical_on_windows_under_wine():
    out = _run(SCRIPTS / "wine_parity.sh", timeout=1800)
    from bitsplit_llama.native import policy

    here = set(policy.families())
    # every x86 family this CPU runs (amx-bf16 aside: wine cannot ask Linux for the tile state) ran on both
    for fam in ("avx2-f32", "avx2-int16", "avxvnni-int16", "avx512vnni-int16", "vnni-int24", "avx512-bf16"):
        if fam in here:
            assert f"kernel_parity: PASS: {fam}," in out, (fam, out[-6000:])
            assert f"wine_parity: {fam}: Windows and Linux results bit-identical" in out, (fam, out[-6000:])
    assert "wine_parity: PASS" in out, out[-6000:]
