"""eyas.cpu: the kind of CPU from its flags, AMX listed but unusable, the EYAS_ISA cap, and the kernels' compile
flags."""
from __future__ import annotations

import pytest

from eyas import cpu

XEON = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16\n"
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu avx2 fma f16c\n"


def test_kind_follows_the_flags():
    assert cpu.kind_of(cpu.cpuinfo_flags(XEON)) == "avx512_bf16"
    assert cpu.kind_of({"avx512f", "avx512bw", "avx512vl", "avx2", "fma"}) == "avx512"
    assert cpu.kind_of({"avx512f", "avx2", "fma"}) == "avx2"  # AVX-512 without BW/VL: the AVX2 paths
    assert cpu.kind_of(cpu.cpuinfo_flags(EPYC_AVX2)) == "avx2"
    assert cpu.kind_of(cpu.cpuinfo_flags("Features\t: fp asimd\n")) == "baseline"
    assert cpu.cpuinfo_flags("") == set()


def test_unusable_amx_is_compiled_out():
    listed_unusable = cpu.CpuFeatures("x", "avx512_bf16", ("amx_tile",), amx_listed=True, amx_usable=False)
    assert "-mno-amx-tile" in cpu.compile_flags(listed_unusable)
    usable = cpu.CpuFeatures("x", "avx512_bf16", ("amx_tile",), amx_listed=True, amx_usable=True)
    assert cpu.compile_flags(usable) == ["-march=native"]


def test_the_isa_cap_drops_the_flags_above_it_and_compiles_without_them(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "PROC_CPUINFO", tmp_path / "cpuinfo")
    (tmp_path / "cpuinfo").write_text(XEON)
    for cap, kind in (("avx512", "avx512"), ("avx2", "avx2"), ("baseline", "baseline"), ("avx512_bf16", "avx512_bf16")):
        monkeypatch.setenv("EYAS_ISA", cap)
        cpu.cpu_features.cache_clear()
        features = cpu.cpu_features()
        assert (features.kind, features.isa_cap, features.amx_listed) == (kind, cap, False)
        flags = cpu.compile_flags(features)
        assert flags[0] == "-march=native" and "-mno-amx-tile" in flags
        assert ("-mno-avx512f" in flags) == (cap in ("avx2", "baseline"))
        assert ("-mno-avx512bf16" in flags) == (cap == "avx512")
    monkeypatch.setenv("EYAS_ISA", "avx2")
    (tmp_path / "cpuinfo").write_text(EPYC_AVX2)  # a cap above the CPU changes nothing
    monkeypatch.setenv("EYAS_ISA", "avx512")
    cpu.cpu_features.cache_clear()
    assert cpu.cpu_features().kind == "avx2"
    monkeypatch.setenv("EYAS_ISA", "sse9")
    cpu.cpu_features.cache_clear()
    with pytest.raises(ValueError, match="EYAS_ISA='sse9': must be one of avx512_bf16, avx512, avx2, baseline"):
        cpu.cpu_features()
    monkeypatch.delenv("EYAS_ISA")
    cpu.cpu_features.cache_clear()


def test_this_machine_is_described():
    features = cpu.cpu_features()
    assert features.kind in cpu.KINDS
    assert set(features.flags) <= set(cpu.RELEVANT_FLAGS)
    assert (features.amx_usable is None) if not features.amx_listed else features.amx_usable in (True, False, None)
    assert features.to_dict()["kind"] == features.kind


@pytest.mark.skipif(cpu.amx_usable() is None, reason="no C compiler for the probe, or not x86-64")
def test_the_amx_probe_answers_without_killing_us():
    # on a CPU without AMX the child dies of SIGILL or is refused the tile state: False, and we are still here
    assert cpu.amx_usable() == ("amx_tile" in cpu.cpu_features().flags and cpu.amx_usable())
