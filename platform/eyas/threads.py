"""One CPU thread policy for every eyas process that runs torch: how many intra-op threads, and how an idle OpenMP
thread waits. docs/threads-and-dtypes.md says why; ``jobs.bench_threads`` measures it against torch's defaults.

torch's defaults (one thread per core; libgomp spins ~300,000 times at every barrier before it sleeps) collapse on a
shared machine: when another process holds one of the cores, every parallel region waits for the thread that shares
that core while the others spin against it, and a decode step runs 3-10x slower. eyas's policy:

- **thread count**: an explicit count (``--threads``, ``torch_threads``) as given. In a Ray worker, the CPUs Ray's
  accounting gave it (its config's ``cpus_per_worker`` / ``worker_cpus`` / ``cpus_per_trial``: no other Ray task
  runs on them), at most the cores. Elsewhere ``OMP_NUM_THREADS`` when set, else leave one physical core to the
  rest of the machine: ``max(1, cores - 1)``, cores being the physical cores this process may run on (CPU affinity,
  a cgroup v2 quota). With one other busy process every thread still has a core of its own; a quiet machine loses
  one core of N (on a quiet 2-core EPYC, bfloat16 decode runs ~1.17x faster at 2 threads, but a 2-thread process
  keeps only ~0.65x of its speed once a busy process starts beside it: docs/threads-and-dtypes.md).
- **wait policy** ``OMP_WAIT_POLICY=PASSIVE``: an idle OpenMP thread sleeps at once instead of spinning, so where
  more processes compete than cores are left, threads do not burn the cores others need. libgomp (torch's OpenMP
  on Linux) and LLVM's libomp both honour it, but only when the library loads, i.e. when torch is first imported:
  it must be in the environment before that. ``set_openmp_env()`` puts it there (the apps' package ``__init__`` and
  tests/conftest.py call it before anything imports torch); Ray workers, actors and Serve replicas get it through
  their ``runtime_env`` env_vars (``eyas_ray.threads``). A value the user set wins.

- **eyas's own kernels adapt** (the panel products and the fused forward: ``kernel_threads()``). Their results do not
  depend on the thread count, so their count may change between two calls without changing a bit. Where the count
  is the policy's own choice (source ``cores-1``), they use every core while the machine is quiet, and one core fewer
  while other processes keep more than half a core of ours busy (``ThreadGovernor``: it reads ``/proc/stat`` at
  most every ``EYAS_THREAD_INTERVAL_S`` seconds, 0.5 by default, from the thread that computes). torch's own count
  (training, ops over many rows) stays fixed, so nothing whose bits depend on the count ever changes; where the
  kernels adapt, a long prefill runs on them too, in chunks of a verify's rows (``kernels_adapt``).
  An explicit count, ``OMP_NUM_THREADS`` or a Ray budget fixes the kernels' count too; ``EYAS_ADAPTIVE_THREADS=0``
  switches adaptation off.

``EYAS_THREAD_POLICY=torch`` leaves torch's and OpenMP's defaults alone (to compare against them).
This module must not import torch at module level: it is imported before torch, to set the environment.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eyas.cpu import CpuReading, CpuWindow, cpu_reading

# what an idle OpenMP thread does; read by the OpenMP runtime once, when torch loads it
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# knobs that change the same behaviour (reported, never set): libgomp's spin count, Intel/LLVM OpenMP's block time
OPENMP_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")
# "torch": leave torch's and OpenMP's defaults alone (to compare against them); "eyas": the policy above
POLICY_VAR = "EYAS_THREAD_POLICY"
POLICIES = ("eyas", "torch")

_set_here: set[str] = set()  # OpenMP variables set_openmp_env() put into os.environ (not the user's own)
_configured: ThreadSettings | None = None  # configure_threads()' last answer, for reports (current_settings)
_governor: ThreadGovernor | None = None  # eyas's kernels' adaptive count (kernel_threads), where the policy adapts
ADAPTIVE_VAR = "EYAS_ADAPTIVE_THREADS"  # "0": eyas's kernels keep torch's count
INTERVAL_VAR = "EYAS_THREAD_INTERVAL_S"  # how often the governor reads the CPU clocks


@dataclass(frozen=True)
class ThreadSettings:
    """What a process runs with: recorded by jobs.bench in bench.json's ``machine``."""
    policy: str               # "eyas" or "torch" (EYAS_THREAD_POLICY)
    num_threads: int          # torch intra-op threads
    source: str               # where the count came from: explicit, OMP_NUM_THREADS, cores-1, budget, torch,
                              # unconfigured (current_settings: set outside configure_threads)
    available_cores: int      # physical cores this process may run on
    openmp: dict[str, str]    # the OpenMP variables in this process's environment
    kernel_threads: tuple[int, int] | None = None  # eyas's kernels' (fewest, most) threads where they adapt

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def thread_policy() -> str:
    policy = os.environ.get(POLICY_VAR, "eyas")
    if policy not in POLICIES:
        raise ValueError(f"{POLICY_VAR}={policy!r}: must be one of {list(POLICIES)}")
    return policy


def openmp_env() -> dict[str, str]:
    """The policy's OpenMP variables that a new process (a Ray worker) must be given: all of them but those the
    user set (which reach it the way the user set them: inherited, or in a submitted job's runtime_env, where
    giving them again would conflict). Empty under EYAS_THREAD_POLICY=torch."""
    if thread_policy() == "torch":
        return {}
    return {key: value for key, value in OPENMP_ENV.items() if key not in os.environ or key in _set_here}


def set_openmp_env() -> dict[str, str]:
    """Put the policy's OpenMP variables into this process's environment, keeping any the user set. Call it before
    torch is imported (later, the OpenMP runtime has read its environment already). Returns what it set."""
    added = {key: value for key, value in openmp_env().items() if key not in os.environ}
    os.environ.update(added)
    _set_here.update(added)
    return added


def available_cores() -> int:
    """Physical cores this process may run on: its CPU affinity counted by core (hyperthreads of one core are one),
    capped by a cgroup v2 CPU quota."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:  # no sysfs topology (containers, macOS): count the logical CPU
            cores.add(("cpu", str(cpu)))
    return max(1, min(len(cores), cgroup_cpu_quota() or len(cores)))


def cgroup_cpu_quota(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """Whole CPUs a cgroup v2 quota allows (``cpu.max``: "QUOTA PERIOD" or "max PERIOD"); None without one."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.floor(int(quota) / int(period)))


def thread_count(num_threads: int | None = None, cpu_budget: float | None = None) -> tuple[int, str]:
    """(intra-op threads, where the number came from) under the policy; see the module docstring."""
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads={num_threads}: must be >= 1 (or unset for the policy's count)")
    if cpu_budget is not None and cpu_budget <= 0:
        raise ValueError(f"cpu_budget={cpu_budget}: must be > 0 (or unset)")
    if num_threads is not None:
        return num_threads, "explicit"
    # inside a Ray worker (a budget is given) Ray itself set OMP_NUM_THREADS to the worker's num_cpus: not a choice
    if cpu_budget is None and os.environ.get("OMP_NUM_THREADS", "").strip():
        text = os.environ["OMP_NUM_THREADS"].split(",")[0].strip()  # OpenMP allows one count per nesting level
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']!r}: expected a positive integer")
        return int(text), "OMP_NUM_THREADS"
    if cpu_budget is not None:  # Ray's accounting gave this worker these CPUs: no other Ray task runs on them
        return max(1, min(math.floor(cpu_budget), available_cores())), "budget"
    return max(1, available_cores() - 1), "cores-1"


def configure_threads(num_threads: int | None = None, cpu_budget: float | None = None) -> ThreadSettings:
    """Apply the policy to this process's torch (``torch.set_num_threads``) and say what it runs with.
    ``num_threads``: an explicit count (a --threads flag); ``cpu_budget``: the CPUs this process was given (a Ray
    worker's num_cpus). Under EYAS_THREAD_POLICY=torch only an explicit count is applied."""
    import torch  # here, not at the top: the module is imported before torch to set OpenMP's environment

    global _configured, _governor
    policy = thread_policy()
    if policy == "torch" and num_threads is None:
        count, source = torch.get_num_threads(), "torch"
    else:
        count, source = thread_count(num_threads, cpu_budget)
        torch.set_num_threads(count)
    cores = available_cores()
    adapts = source == "cores-1" and cores > count and os.environ.get(ADAPTIVE_VAR, "1") != "0"
    _governor = ThreadGovernor(count, cores) if adapts else None
    _configured = ThreadSettings(policy, count, source, cores, openmp_variables(),
                                 (count, cores) if adapts else None)
    return _configured


def kernels_adapt() -> bool:
    """Whether eyas's kernels' thread count adapts (``configure_threads``: the policy's own count, so the governor may
    give them more cores than torch's fixed count has). A long prefill then runs on them in chunks
    (``eyas.models.fused.FusedLayers.chunk``): torch's count would leave the extra core idle. Fixed for the process
    until the next ``configure_threads``, so a prompt's bits never depend on the machine's load."""
    return _governor is not None


def kernel_threads() -> int:
    """How many threads eyas's own kernels (panel products, the fused forward) use for the call about to run: the
    governor's count where they adapt (``configure_threads``), else torch's."""
    if _governor is None:
        import torch  # loaded already by whoever runs a kernel

        return torch.get_num_threads()
    return _governor.tick()


class ThreadGovernor:
    """eyas's kernels' thread count between ``fewest`` and ``most``: ``most`` while other processes use less than
    ``QUIET_CORES`` of our cores, ``fewest`` once they use more than ``BUSY_CORES`` (between the two it keeps its
    count). A reading costs two small file reads; ``tick`` takes one at most every ``interval_s``."""
    QUIET_CORES = 0.25
    BUSY_CORES = 0.5

    def __init__(self, fewest: int, most: int, interval_s: float | None = None) -> None:
        if not 1 <= fewest <= most:
            raise ValueError(f"ThreadGovernor({fewest}, {most}): needs 1 <= fewest <= most")
        self.fewest, self.most = fewest, most
        self.interval_s = interval_s if interval_s is not None else float(os.environ.get(INTERVAL_VAR, "0.5"))
        self.count = fewest  # start modest: the first window says whether the machine is quiet
        self._last: CpuReading | None = None
        self._next_s = 0.0

    def tick(self) -> int:
        now = time.monotonic()
        if now >= self._next_s:
            self._next_s = now + self.interval_s
            reading = cpu_reading()
            if self._last is not None:
                self.count = self.decide(CpuWindow(self._last, reading).others_cores)
            self._last = reading
        return self.count

    def decide(self, others_cores: float | None) -> int:
        """The count after a window in which other processes used ``others_cores`` of our cores (None: no
        /proc/stat, keep the count)."""
        if others_cores is None:
            return self.count
        if others_cores > self.BUSY_CORES:
            return self.fewest
        if others_cores < self.QUIET_CORES:
            return self.most
        return self.count


def current_settings() -> ThreadSettings:
    """What this process runs with now, for a report (jobs.bench's ``machine``): configure_threads()' answer while
    torch's count is still the one it set, else torch's count with source "unconfigured"."""
    import torch  # here, not at the top: see configure_threads

    if _configured is not None and _configured.num_threads == torch.get_num_threads():
        return _configured
    return ThreadSettings(thread_policy(), torch.get_num_threads(), "unconfigured", available_cores(),
                          openmp_variables())


def openmp_variables() -> dict[str, str]:
    """The OpenMP variables in this process's environment."""
    return {key: os.environ[key] for key in OPENMP_KNOBS if key in os.environ}
