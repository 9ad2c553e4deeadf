"""eyas.models.panels: the panel kernel's products equal F.linear's, a row's outputs do not depend on how many rows
are multiplied with it, PackedLinear routes a few float32 rows through it, and a missing compiler falls back."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eyas.models import panels
from eyas.models.packing import PackedLinear

pytestmark = pytest.mark.skipif(not panels.available(), reason="no C compiler here: the fallback test covers it")


@pytest.mark.parametrize("num_out,num_in", [(96, 64), (70, 33), (5, 16), (960, 576)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 32, 64])
def test_panel_product_equals_linear(num_out, num_in, rows):
    generator = torch.Generator().manual_seed(num_out * 100 + rows)
    weight_OI = torch.randn(num_out, num_in, generator=generator)
    x_MI = torch.randn(rows, num_in, generator=generator)
    y_MO = panels.matmul(x_MI, panels.pack(weight_OI), num_out)
    assert y_MO.shape == (rows, num_out)
    torch.testing.assert_close(y_MO, F.linear(x_MI, weight_OI), atol=1e-4, rtol=1e-5)


def test_a_row_is_bit_identical_at_any_number_of_rows():
    generator = torch.Generator().manual_seed(0)
    weight_OI = torch.randn(200, 96, generator=generator)
    panels_PIW = panels.pack(weight_OI)
    x_MI = torch.randn(32, 96, generator=generator)
    together_MO = panels.matmul(x_MI, panels_PIW, 200)
    for row in range(32):
        assert torch.equal(panels.matmul(x_MI[row:row + 1], panels_PIW, 200)[0], together_MO[row])


def test_packed_linear_uses_panels_for_few_rows_only(monkeypatch):
    torch.set_num_threads(1)
    weight_OI, bias_O = torch.randn(64, 48), torch.randn(64)
    linear = PackedLinear(weight_OI, bias_O)
    assert linear.panels_PIW is not None
    calls = []
    real = panels.matmul
    monkeypatch.setattr(panels, "matmul", lambda *a: calls.append(a[0].shape) or real(*a))
    for shape in [(1, 48), (2, 3, 48), (80, 48)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(linear(x), F.linear(x, weight_OI, bias_O), atol=1e-4, rtol=1e-5)
    assert calls == [(1, 48), (2, 3, 48)]  # 80 rows: past MAX_ROWS, torch's kernel
    x = torch.randn(1, 48, requires_grad=True)
    linear(x)  # a gradient is wanted: torch's kernel
    assert len(calls) == 2


bf16 = pytest.mark.skipif(not panels.available(torch.bfloat16), reason="no AVX512_BF16 here: torch's kernels")


@bf16
@pytest.mark.parametrize("num_out,num_in", [(96, 64), (70, 33), (5, 16), (960, 576)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32, 64])
def test_bfloat16_panel_product_is_the_float32_product_rounded(num_out, num_in, rows):
    generator = torch.Generator().manual_seed(num_out * 100 + rows)
    weight_OI = torch.randn(num_out, num_in, generator=generator).bfloat16()
    x_MI = torch.randn(rows, num_in, generator=generator).bfloat16()
    y_MO = panels.matmul(x_MI, panels.pack(weight_OI), num_out)
    assert y_MO.shape == (rows, num_out) and y_MO.dtype == torch.bfloat16
    exact_MO = x_MI.float() @ weight_OI.float().t()  # bfloat16 inputs' products are exact in float32
    # one rounding to bfloat16 (relative 2^-8) on top of float32 sums in another order
    torch.testing.assert_close(y_MO.float(), exact_MO, atol=1e-3, rtol=2 ** -8)


@bf16
def test_a_bfloat16_row_is_bit_identical_at_any_number_of_rows():
    generator = torch.Generator().manual_seed(1)
    weight_OI = torch.randn(200, 97, generator=generator).bfloat16()
    panels_PIW = panels.pack(weight_OI)
    x_MI = torch.randn(32, 97, generator=generator).bfloat16()
    together_MO = panels.matmul(x_MI, panels_PIW, 200)
    for row in range(32):
        assert torch.equal(panels.matmul(x_MI[row:row + 1], panels_PIW, 200)[0], together_MO[row])


@bf16
def test_packed_linear_uses_bfloat16_panels_for_bfloat16_rows_only(monkeypatch):
    torch.set_num_threads(1)
    weight_OI = torch.randn(64, 48).bfloat16()
    linear = PackedLinear(weight_OI)
    assert linear.panels_PIW is not None and linear.panels_PIW.dtype == torch.bfloat16
    calls = []
    real = panels.matmul
    monkeypatch.setattr(panels, "matmul", lambda *a: calls.append(a[0].dtype) or real(*a))
    x = torch.randn(2, 48).bfloat16()
    torch.testing.assert_close(linear(x).float(), F.linear(x, weight_OI).float(), atol=1e-2, rtol=2 ** -7)
    assert calls == [torch.bfloat16]


def _cpu_has_amx() -> bool:
    from pathlib import Path
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return {"amx_tile", "amx_bf16"} <= set(flags.split())


@bf16
def test_the_amx_kernel_runs_where_the_cpu_has_amx():
    assert panels.uses_amx() == _cpu_has_amx()  # EYAS_AMX is not set in the tests


amx = pytest.mark.skipif(not panels.uses_amx(), reason="no AMX here: the vector kernel's tests cover bfloat16")


@amx
@pytest.mark.parametrize("num_out,num_in", [(70, 33), (960, 576), (200, 1728)])
def test_amx_and_vector_kernels_agree_and_each_keeps_a_row_at_any_number_of_rows(num_out, num_in):
    generator = torch.Generator().manual_seed(num_in)
    weight_OI = torch.randn(num_out, num_in, generator=generator).bfloat16()
    panels_PIW = panels.pack(weight_OI)
    x_MI = torch.randn(40, num_in, generator=generator).bfloat16()  # 16-row tile blocks, and a part block
    by_kernel = {}
    try:
        for on in (True, False):
            assert panels.set_amx(on) == on
            together_MO = panels.matmul(x_MI, panels_PIW, num_out)
            for row in (0, 15, 16, 17, 39):
                assert torch.equal(panels.matmul(x_MI[row:row + 1], panels_PIW, num_out)[0], together_MO[row])
            by_kernel[on] = together_MO
    finally:
        panels.set_amx(True)
    exact_MO = x_MI.float() @ weight_OI.float().t()
    for y_MO in by_kernel.values():
        torch.testing.assert_close(y_MO.float(), exact_MO, atol=1e-3, rtol=2 ** -8)
    # the two sum in different orders: they may differ by one bfloat16 rounding, rarely more
    torch.testing.assert_close(by_kernel[True].float(), by_kernel[False].float(), atol=1e-3, rtol=2 ** -7)


@amx
def test_eyas_amx_0_keeps_the_vector_kernel(tmp_path):
    import os
    import subprocess
    import sys
    code = "from eyas.models import panels\nprint(panels.uses_amx())\n"
    env = {**os.environ, "EYAS_AMX": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=bf16)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_thread_pool_splits_panels_without_changing_a_bit(dtype, rows):
    """Above the pool's size threshold (256 KiB of weights) the panels split over the threads; each output stays
    one thread's sum in the one-thread order."""
    generator = torch.Generator().manual_seed(rows)
    weight_OI = torch.randn(1000, 576, generator=generator).to(dtype)
    panels_PIW = panels.pack(weight_OI)
    x_MI = torch.randn(rows, 576, generator=generator).to(dtype)
    before = torch.get_num_threads()
    try:
        by_threads = []
        for num_threads in (1, 2, 3, 2):
            torch.set_num_threads(num_threads)
            by_threads.append(panels.matmul(x_MI, panels_PIW, 1000))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(y_MO, by_threads[0]) for y_MO in by_threads[1:])


def test_products_from_two_python_threads_at_once_keep_their_bits():
    """ctypes lets go of the GIL: a second thread's product runs on its caller alone while the pool is taken."""
    import threading
    generator = torch.Generator().manual_seed(3)
    weight_OI = torch.randn(1000, 576, generator=generator)
    panels_PIW = panels.pack(weight_OI)
    x_MI = torch.randn(4, 576, generator=generator)
    expected_MO = panels.matmul(x_MI, panels_PIW, 1000)
    before, failures = torch.get_num_threads(), []
    torch.set_num_threads(2)

    def work():
        for _ in range(200):
            if not torch.equal(panels.matmul(x_MI, panels_PIW, 1000), expected_MO):
                failures.append(1)
    try:
        workers = [threading.Thread(target=work) for _ in range(3)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        torch.set_num_threads(before)
    assert not failures
