"""eyas.threads: the thread count rules, the OpenMP environment (set before torch loads, the user's values kept),
and that libgomp really reads it when an eyas app imports torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eyas import threads
from eyas_ray.threads import with_openmp_env

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def clean_env(monkeypatch):
    """No OpenMP variables, nothing recorded as set by eyas, 4 physical cores."""
    for key in (*threads.OPENMP_KNOBS, threads.POLICY_VAR):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(threads, "_set_here", set())
    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    return monkeypatch


def test_count_leaves_one_core_outside_ray_and_uses_the_budget_inside(clean_env):
    assert threads.thread_count() == (3, "cores-1")
    assert threads.thread_count(cpu_budget=2) == (2, "budget")
    assert threads.thread_count(cpu_budget=0.5) == (1, "budget")  # a fractional Ray CPU still runs one thread
    assert threads.thread_count(cpu_budget=8) == (4, "budget")  # never more threads than cores
    assert threads.thread_count(num_threads=6, cpu_budget=2) == (6, "explicit")
    clean_env.setattr(threads, "available_cores", lambda: 1)
    assert threads.thread_count() == (1, "cores-1")


def test_omp_num_threads_is_the_users_count_outside_ray(clean_env):
    clean_env.setenv("OMP_NUM_THREADS", "2,1")  # OpenMP's per-nesting-level list: the first level counts
    assert threads.thread_count() == (2, "OMP_NUM_THREADS")
    assert threads.thread_count(cpu_budget=3) == (3, "budget")  # in a Ray worker Ray set it: the budget decides
    clean_env.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='many'"):
        threads.thread_count()
    with pytest.raises(ValueError, match="num_threads=0"):
        threads.thread_count(num_threads=0)
    with pytest.raises(ValueError, match="cpu_budget=0"):
        threads.thread_count(cpu_budget=0)


def test_cgroup_quota(tmp_path):
    quota = tmp_path / "cpu.max"
    assert threads.cgroup_cpu_quota(quota) is None  # no file: no quota
    for text, cpus in (("max 100000", None), ("250000 100000", 2), ("50000 100000", 1)):
        quota.write_text(text + "\n")
        assert threads.cgroup_cpu_quota(quota) == cpus


def test_openmp_env_keeps_the_users_values(clean_env):
    assert threads.set_openmp_env() == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert threads.openmp_env() == {"OMP_WAIT_POLICY": "PASSIVE"}  # what eyas set travels to Ray workers
    # a value the user set is kept, and not given again to a runtime_env (a submitted job's env has it already)
    clean_env.setattr(threads, "_set_here", set())
    clean_env.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert threads.set_openmp_env() == {} and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert threads.openmp_env() == {}
    assert with_openmp_env({"env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"}}
    clean_env.delenv("OMP_WAIT_POLICY")
    assert with_openmp_env({"working_dir": ".", "env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}) == {
        "working_dir": ".", "env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}  # the caller's runtime_env wins
    assert with_openmp_env() == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}
    clean_env.setenv(threads.POLICY_VAR, "torch")
    assert threads.openmp_env() == {} and with_openmp_env() == {}
    clean_env.setenv(threads.POLICY_VAR, "fast")
    with pytest.raises(ValueError, match="EYAS_THREAD_POLICY='fast'"):
        threads.openmp_env()


def libgomp_settings(policy: str) -> tuple[str, dict]:
    """libgomp's own report of what it read when an eyas app (the jobs package) imported torch, and the policy
    the process then ran with."""
    env = {k: v for k, v in os.environ.items() if k not in threads.OPENMP_KNOBS}
    env.update({threads.POLICY_VAR: policy, "OMP_DISPLAY_ENV": "VERBOSE"})  # libgomp prints its settings on load
    code = ("import json, jobs, torch; from eyas.threads import configure_threads; "
            "print(json.dumps(configure_threads().to_dict()))")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr, json.loads(done.stdout.strip().splitlines()[-1])


def test_libgomp_reads_the_wait_policy_when_an_app_imports_torch():
    report, settings = libgomp_settings("eyas")
    assert "GOMP_SPINCOUNT = '0'" in report, report[-2000:]  # PASSIVE read at load: idle threads never spin
    assert settings["openmp"] == {"OMP_WAIT_POLICY": "PASSIVE"} and settings["policy"] == "eyas"
    assert settings["num_threads"] == max(1, threads.available_cores() - 1) and settings["source"] == "cores-1"
    report, settings = libgomp_settings("torch")  # the stock behaviour, for comparisons: spin, then sleep
    assert "GOMP_SPINCOUNT = '300000'" in report, report[-2000:]
    assert settings["openmp"] == {} and settings["source"] == "torch"


def test_governor_uses_every_core_when_quiet_and_one_fewer_beside_a_busy_process(monkeypatch):
    """Fake CPU clocks: 1 s windows in which other processes use 0.1, 0.9, 0.4 (between the bounds: keep), 0.1
    cores; the governor reads them from the computing thread, at most once an interval."""
    readings = iter([(0.0, 0.0), (1.0, 0.1), (2.0, 1.0), (3.0, 1.4), (4.0, 1.5)])  # (wall, others' busy seconds)
    clock = {"now": 0.0}

    def fake_reading():
        wall, busy = next(readings)
        return threads.CpuReading(wall_s=wall, cores_busy_s=busy, own_s=0.0, load_1m=0.0, num_cores=2)

    monkeypatch.setattr(threads, "cpu_reading", fake_reading)
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["now"])
    governor = threads.ThreadGovernor(1, 2, interval_s=1.0)
    assert governor.tick() == 1  # no window yet: start modest
    clock["now"] = 0.5
    assert governor.tick() == 1  # within the interval: no reading taken
    counts = []
    for now in (1.0, 2.0, 3.0, 4.0):
        clock["now"] = now
        counts.append(governor.tick())
    assert counts == [2, 1, 1, 2]
    assert governor.decide(None) == 2  # no /proc/stat: keep the count
    with pytest.raises(ValueError, match="fewest <= most"):
        threads.ThreadGovernor(3, 2)


def test_only_the_policys_own_count_adapts_and_torch_keeps_its_count(clean_env):
    import torch

    before = torch.get_num_threads()
    try:
        settings = threads.configure_threads()  # cores-1 of 4: the kernels adapt between 3 and 4
        assert (settings.num_threads, settings.source, settings.kernel_threads) == (3, "cores-1", (3, 4))
        assert torch.get_num_threads() == 3 and threads.kernel_threads() in (3, 4)
        assert threads.kernels_adapt()  # a long prefill then runs on the kernels (eyas.models.fused.chunk)
        assert threads.configure_threads(num_threads=2).kernel_threads is None  # an explicit count is fixed
        assert threads.kernel_threads() == torch.get_num_threads() == 2 and not threads.kernels_adapt()
        assert threads.configure_threads(cpu_budget=2).kernel_threads is None  # a Ray budget too
        clean_env.setenv(threads.ADAPTIVE_VAR, "0")
        assert threads.configure_threads().kernel_threads is None
        clean_env.delenv(threads.ADAPTIVE_VAR)
        clean_env.setattr(threads, "available_cores", lambda: 1)
        assert threads.configure_threads().kernel_threads is None  # one core: nothing to adapt
    finally:
        threads.configure_threads(num_threads=before)
