"""Without a working C compiler neither the panel kernel nor the attention kernel is built, a warning says so, and
PackedLinear and the decoder's attention keep torch's kernels (a fresh process: the builds are cached per process)."""
from __future__ import annotations

import os
import subprocess
import sys


def test_no_compiler_falls_back_with_a_warning(tmp_path):
    code = ("import warnings, torch, torch.nn.functional as F\n"
            "from eyas.models import panels\nfrom eyas.models.packing import PackedLinear\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    ok = panels.available()\n"
            "assert not ok and any('did not build' in str(w.message) for w in caught), caught\n"
            "w = torch.randn(40, 24); x = torch.randn(1, 24)\n"
            "lin = PackedLinear(w)\nassert lin.panels_PIW is None\n"
            "torch.testing.assert_close(lin(x), F.linear(x, w))\n"
            "from eyas.models import attention\nfrom eyas.models.decoder import attend\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    ok = attention.available()\n"
            "assert not ok and any('attention kernel did not build' in str(w.message) for w in caught), caught\n"
            "q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)\n"
            "ref = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 7, dtype=torch.bool).tril(4),"
            " enable_gqa=True)\n"
            "torch.testing.assert_close(attend(q, k, v, None, True), ref)\nprint('fallback ok')\n")
    env = {"PATH": "/usr/bin:/bin", "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "fallback ok" in done.stdout, done.stderr
    assert not list((tmp_path / "cache").rglob("*.so*"))  # nothing half-written left behind
