"""EYAS_ISA=avx2 on a bigger CPU: the kernels are compiled without AVX-512 and every kernel test passes on them, so
CI covers the AVX2 paths wherever it runs: the bfloat16 panel kernel is AVX2's (widened inputs and FMAs, where
AVX512_BF16 has vdpbf16ps), and the Q8_0 product runs its AVX2 loop (vpmaddubsw, where AVX512_VNNI has vpdpbusd)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eyas import cpu

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).parent


@pytest.mark.skipif(cpu.cpu_features().kind not in ("avx512", "avx512_bf16"), reason="no AVX-512 here to cap")
def test_kernels_capped_to_avx2_pass_the_kernel_tests():
    env = {**os.environ, "EYAS_ISA": "avx2", "OMP_NUM_THREADS": "2"}
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; from eyas.cpu import cpu_features; from eyas.models import panels, fused; "
         "print(cpu_features().kind, panels.available(torch.float32), panels.available(torch.bfloat16), "
         "fused._library() is not None)"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split() == ["avx2", "True", "True", "True"]
    tests = [str(HERE / name) for name in ("test_panels.py", "test_attention.py", "test_fused.py", "test_q8_0.py")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout.splitlines()[-1]
