"""The CPU path gives the same bits on every x86-64 host.

Under the Triton interpreter a kernel is computed by numpy, whose matmul (OpenBLAS) and float32
transcendentals pick their code by CPU; det_core.interpreter replaces both with separately
rounded IEEE operations. Here each host is emulated in a fresh process: numpy's SIMD dispatch is
limited with ``NPY_DISABLE_CPU_FEATURES`` (AVX2 only, or the SSE baseline only), OpenBLAS's kernel
is forced with ``OPENBLAS_CORETYPE`` (Haswell, Prescott) and torch's CPU kernels with
``ATEN_CPU_CAPABILITY=avx2``; tests/host_probe.py prints digests of matmul rows (fp32, bf16), a
Linear's dW and db with a micro-batch cut inside a leaf, attention forward and backward (padded and
packed), cross-entropy and RMSNorm, and two steps of the main job's tiny preset (at a global batch
of 4 sequences). Every emulated host must print the native host's digests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._e2e_runs import _once_per_run

PROBE = Path(__file__).resolve().parent / "host_probe.py"
# numpy 2.4's dispatch groups above the x86-64 baseline (X86_V2); disabling a group the host lacks
# is a no-op, so these read the same on any x86-64 CPU
AVX512 = "X86_V4 AVX512_ICL AVX512_SPR"
HOSTS = {
    "avx2 (numpy AVX2, OpenBLAS Haswell, torch avx2)": {
        "NPY_DISABLE_CPU_FEATURES": AVX512,
        "OPENBLAS_CORETYPE": "Haswell",
        "ATEN_CPU_CAPABILITY": "avx2",
    },
    "sse (numpy baseline, OpenBLAS Prescott, torch avx2)": {
        "NPY_DISABLE_CPU_FEATURES": "X86_V3 " + AVX512,
        "OPENBLAS_CORETYPE": "Prescott",
        "ATEN_CPU_CAPABILITY": "avx2",
    },
}


def _host_has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _probe(env: dict[str, str]) -> dict[str, str]:
    child = {**os.environ, **env, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(PROBE)], env=child, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"host probe failed under {env}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _native() -> dict[str, str]:
    return _once_per_run("host-probe-native", lambda _folder: _probe({}))


@pytest.mark.parametrize("host", list(HOSTS))
def test_emulated_host_gives_the_native_bits(host):
    if not _host_has_avx2():  # the Haswell kernels and torch's avx2 code need AVX2 to run at all
        pytest.skip("this CPU has no AVX2: the AVX2 emulations cannot run here")
    emulated, native = _probe(HOSTS[host]), _native()
    assert set(emulated) == set(native) and len(native) >= 6
    differ = {
        name: (native[name][:16], emulated[name][:16]) for name in native if emulated[name] != native[name]
    }
    assert not differ, f"{host}: other bits than the native host for {differ}"
