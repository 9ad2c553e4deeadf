"""ggml's CPU instruction-set CMake flags, chosen from what this CPU lists in /proc/cpuinfo.

``-DGGML_NATIVE=ON`` compiles in everything the build machine's CPUID advertises, AMX included. On some VMs CPUID
lists AMX but the tile state is not usable, and ggml's AMX kernels die with SIGILL (``tilezero``). So the build
turns NATIVE off and names each extension this CPU offers, with AMX always off.

Stdlib only: ``make tools-llamacpp`` runs it as a script (``python3 jobs/peers/ggml_isa.py``) before any venv
exists. It prints the CMake arguments on one line.
"""
import sys

# ggml option -> the /proc/cpuinfo flags it needs, all of them (GGML_AVX512 compiles -mavx512f/cd/vl/dq/bw)
GGML_ISA_REQUIREMENTS = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
# Never on: CPUID may list AMX on a VM whose tile state is unusable (SIGILL at the first tile instruction)
GGML_ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo_text: str) -> frozenset[str]:
    """The ``flags`` of the first processor in a /proc/cpuinfo text (x86); empty when there is none."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def ggml_isa_options(flags: frozenset[str]) -> dict[str, bool]:
    """Every ggml ISA option, on exactly when the CPU lists all the flags it needs; AMX always off."""
    options = {name: all(flag in flags for flag in needed) for name, needed in GGML_ISA_REQUIREMENTS.items()}
    if options["GGML_AVX512"] is False:
        # the AVX512 extensions compile only on top of GGML_AVX512's base flags
        for name in ("GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"):
            options[name] = False
    options.update({name: False for name in GGML_ALWAYS_OFF})
    return options


def cmake_isa_args(cpuinfo_text: str) -> list[str]:
    """``-DGGML_NATIVE=OFF`` and one ``-DGGML_X=ON|OFF`` per ISA option, for this cpuinfo text.

    A CPU without a flags line (not x86, or no /proc) keeps ggml's portable defaults: only NATIVE off and AMX off.
    """
    flags = cpu_flags(cpuinfo_text)
    if not flags:
        return ["-DGGML_NATIVE=OFF"] + [f"-D{name}=OFF" for name in GGML_ALWAYS_OFF]
    options = ggml_isa_options(flags)
    return ["-DGGML_NATIVE=OFF"] + [f"-D{name}={'ON' if on else 'OFF'}" for name, on in options.items()]


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "/proc/cpuinfo"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    print(" ".join(cmake_isa_args(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
