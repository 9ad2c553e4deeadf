"""The CPU this process runs on: what its instruction sets offer (and whether an advertised one works), and who uses
its cores (``cpu_reading`` / ``CpuWindow``).

**Instruction sets.** ``cpu_features()`` reads the flags the kernel lists (``/proc/cpuinfo``) and names the kind of
CPU eyas's kernels are built for: ``avx512_bf16`` (native bfloat16 dot products: the bfloat16 panel kernel), ``avx512``,
``avx2`` or ``baseline``. A listed flag is not always usable: on the Xeon VMs here CPUID lists AMX, but the tile state
is not enabled, and llama.cpp's AMX kernels die with SIGILL (``tilezero``). Linux gives a process the tile state only
after ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, and only where the hypervisor enabled it;
``amx_usable()`` asks for it in a child process that then runs one tile instruction, so a SIGILL kills the child and
not us. eyas's kernels use no AMX instruction; their compiler is told so where AMX is listed but unusable
(``compile_flags``), and bench.json records the kind (``jobs.bench``'s ``machine``).

``EYAS_ISA`` caps the kind (one of ``KINDS``): the flags above it are dropped from what eyas sees and its kernels are
compiled without them (``-mno-avx512f`` for ``avx2``, ...), so one machine runs and tests the paths a smaller CPU
gets. torch and oneDNN have their own caps: ``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2`` (set before
torch loads) make a whole process behave like an AVX2 CPU's; docs/threads-and-dtypes.md has the figures.

**Who uses the cores.** Two ``cpu_reading()``s bracket a measurement; the ``CpuWindow`` between them says how many
cores this process and every other process used on average (busy time of our cores from ``/proc/stat``, less our own
CPU time, over the wall time). The cost model's warnings (``eyas.decoding.costs``) and the adaptive thread policy
(``eyas.threads``) read it. Where the OS has no ``/proc/stat`` (macOS) ``others_cores`` is None.

This module must not import torch: ``eyas.threads`` imports it before torch loads.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

PROC_STAT = Path("/proc/stat")
PROC_CPUINFO = Path("/proc/cpuinfo")
KINDS = ("avx512_bf16", "avx512", "avx2", "baseline")  # best first
AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")
ISA_ENV = "EYAS_ISA"
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16", "avx512_fp16")
# the listed flags each cap drops, and the compiler switches that keep the kernels off them (GCC's -mno-avx512f
# turns off every AVX-512 extension; -mno-avx2 leaves AVX)
_ABOVE = {"avx512_bf16": AMX_FLAGS, "avx512": ("avx512_bf16", "avx512_fp16", *AMX_FLAGS),
          "avx2": (*AVX512_FLAGS, *AMX_FLAGS), "baseline": ("avx2", "fma", "f16c", "avx_vnni", *AVX512_FLAGS, *AMX_FLAGS)}
_NO = {"avx512_bf16": ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
       "avx512": ["-mno-avx512bf16", "-mno-avx512fp16", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
       "avx2": ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
       "baseline": ["-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8",
                    "-mno-amx-bf16"]}

# Run one tile instruction after asking Linux for the tile state: exit 0 where AMX works, 2 where the kernel
# refuses the state; a SIGILL (the tile state not enabled by the hypervisor) kills the child.
AMX_PROBE_C = r"""
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
int main(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 2;
  __asm__ volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0xc0" ::: "memory");  /* tilerelease */
  return 0;
}
"""


@dataclass(frozen=True)
class CpuFeatures:
    """What the CPU offers eyas's kernels; recorded in bench.json's ``machine.cpu_features``."""
    model: str | None        # /proc/cpuinfo's "model name"
    kind: str                # the best of KINDS its flags allow
    flags: tuple[str, ...]   # the listed flags eyas's or its peers' kernels care about
    amx_listed: bool         # CPUID lists AMX tiles
    amx_usable: bool | None  # a child process ran a tile instruction (None: not listed, or no compiler to probe)
    isa_cap: str | None = None  # EYAS_ISA: the kind this process was capped to (flags above it dropped)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi",
                  "avx512_bf16", "avx512_fp16", "avx_vnni", *AMX_FLAGS)


def cpuinfo_flags(text: str) -> set[str]:
    """The flags of the first processor in a /proc/cpuinfo text (x86: ``flags``; ARM: ``Features``)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def kind_of(flags: set[str]) -> str:
    """The best kind of KINDS these flags allow (AVX-512 needs F, BW and VL, as the kernels' paths do)."""
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "baseline"


@lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This machine's CPU (read once per process)."""
    try:
        text = PROC_CPUINFO.read_text()
    except OSError:
        text = ""
    cap = isa_cap()
    flags = cpuinfo_flags(text) - set(_ABOVE[cap] if cap else ())
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 None)
    listed = "amx_tile" in flags
    return CpuFeatures(model=model, kind=kind_of(flags), flags=tuple(f for f in RELEVANT_FLAGS if f in flags),
                       amx_listed=listed, amx_usable=amx_usable() if listed else None, isa_cap=cap)


def isa_cap() -> str | None:
    """``EYAS_ISA``: the kind of ``KINDS`` to cap this process's kernels to, or None (unset or empty)."""
    cap = os.environ.get(ISA_ENV, "").strip() or None
    if cap is not None and cap not in KINDS:
        raise ValueError(f"{ISA_ENV}={cap!r}: must be one of {', '.join(KINDS)} (or unset: the CPU's own)")
    return cap


@lru_cache(maxsize=1)
def amx_usable() -> bool | None:
    """Whether this process may run AMX tile instructions: a child asks Linux for the tile state and runs one
    (None where there is no C compiler to build the probe, or not on x86-64)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if platform.machine() not in ("x86_64", "AMD64") or not compiler:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "amx_probe.c", Path(tmp) / "amx_probe"
        source.write_text(AMX_PROBE_C)
        try:
            subprocess.run([compiler, "-O1", "-o", str(binary), str(source)], check=True, capture_output=True,
                           timeout=60)
            return subprocess.run([str(binary)], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return None


def compile_flags(features: CpuFeatures) -> list[str]:
    """The instruction-set flags eyas's C kernels are compiled with: the host's own (``-march=native``), less AMX
    where it is listed but not usable, so no compiler ever emits a tile instruction that would SIGILL, and less
    everything above ``EYAS_ISA``'s cap."""
    flags = ["-march=native", *(_NO[features.isa_cap] if features.isa_cap else [])]
    if features.amx_listed and not features.amx_usable:
        flags += [f for f in ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16") if f not in flags]
    return flags


# ---------------------------------------------------------------- who uses the cores


@dataclass(frozen=True)
class CpuReading:
    """The CPU clocks at one instant; two of them bracket a measurement (``CpuWindow``)."""
    wall_s: float  # time.monotonic()
    cores_busy_s: float | None  # busy seconds of the cores we may run on, all processes, summed (None: no /proc/stat)
    own_s: float  # this process's CPU seconds: every thread, user + system, and children it waited for
    load_1m: float  # the 1-minute load average (0.0 where the OS has none)
    num_cores: int  # the cores we may run on (CPU affinity), all of them without /proc/stat


@dataclass(frozen=True)
class CpuWindow:
    """Who used the CPU between two readings."""
    start: CpuReading
    end: CpuReading

    @property
    def wall_s(self) -> float:
        return self.end.wall_s - self.start.wall_s

    @property
    def own_cores(self) -> float:
        """Cores this process used on average (2.0: two threads busy all along)."""
        return (self.end.own_s - self.start.own_s) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def others_cores(self) -> float | None:
        """Cores of ours every other process used on average (None without /proc/stat). The kernel counts both
        clocks in ticks (10 ms each, per core), so a window of a few seconds reads to a few hundredths."""
        if self.start.cores_busy_s is None or self.end.cores_busy_s is None or self.wall_s <= 0:
            return None
        busy = self.end.cores_busy_s - self.start.cores_busy_s
        return max(0.0, busy / self.wall_s - self.own_cores)

    def to_dict(self) -> dict[str, float | int | str | None]:
        others = self.others_cores
        return {"wall_s": round(self.wall_s, 2), "num_cores": self.end.num_cores,
                "own_cores": round(self.own_cores, 2), "others_cores": None if others is None else round(others, 2),
                "source": "/proc/stat" if others is not None else "load average (no /proc/stat)",
                "load_average": {"start": round(self.start.load_1m, 2), "end": round(self.end.load_1m, 2)}}


def _cores_busy_seconds(cores: set[int]) -> float | None:
    """Busy seconds since boot of ``cores``, all processes (None without /proc/stat). A ``cpuN`` line reads user
    nice system idle iowait irq softirq steal guest guest_nice, in clock ticks; busy is all but idle, iowait and
    steal (another virtual machine's time, not a process here), and guest time is inside user and nice already."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
            ticks += user + nice + system + irq + softirq
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_reading() -> CpuReading:
    """The CPU clocks now: take one before and one after a measurement, ``CpuWindow(start, end)``."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    busy = _cores_busy_seconds(cores)
    own = os.times()
    return CpuReading(wall_s=time.monotonic(), cores_busy_s=busy,
                      own_s=own.user + own.system + own.children_user + own.children_system,
                      load_1m=load_average(), num_cores=len(cores) if busy is not None else os.cpu_count() or 1)



def load_average() -> float:
    """The 1-minute load average (0.0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


