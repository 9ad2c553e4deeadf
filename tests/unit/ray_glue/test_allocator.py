"""eyas_ray.allocator: which allocator a training process preloads, and that a user's own choice is kept."""
from __future__ import annotations

import pytest

from eyas_ray import allocator
from eyas_ray.threads import with_env_vars


@pytest.fixture()
def clean_env(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(allocator.ALLOCATOR_VAR, raising=False)
    return monkeypatch


def test_auto_prefers_tcmalloc_then_rays_jemalloc_then_glibc(clean_env):
    clean_env.setattr(allocator, "tcmalloc_library", lambda: "libtcmalloc_minimal.so.4")
    clean_env.setattr(allocator, "jemalloc_library", lambda: "/ray/core/libjemalloc.so")
    assert allocator.preload_env() == {"LD_PRELOAD": "libtcmalloc_minimal.so.4"}
    clean_env.setenv(allocator.ALLOCATOR_VAR, "jemalloc")
    assert allocator.preload_env() == {"LD_PRELOAD": "/ray/core/libjemalloc.so"}
    clean_env.setenv(allocator.ALLOCATOR_VAR, "system")
    assert allocator.preload_env() == {}
    clean_env.setenv(allocator.ALLOCATOR_VAR, "auto")
    clean_env.setattr(allocator, "tcmalloc_library", lambda: None)
    assert allocator.preload_env() == {"LD_PRELOAD": "/ray/core/libjemalloc.so"}
    clean_env.setattr(allocator, "jemalloc_library", lambda: None)
    assert allocator.preload_env() == {}  # neither installed: glibc's


def test_a_users_preload_and_bad_choices(clean_env):
    clean_env.setenv("LD_PRELOAD", "/opt/mine.so")
    assert allocator.preload_env() == {}  # theirs reaches the workers as they set it
    clean_env.delenv("LD_PRELOAD")
    clean_env.setenv(allocator.ALLOCATOR_VAR, "mimalloc")
    with pytest.raises(ValueError, match="EYAS_ALLOCATOR='mimalloc'"):
        allocator.preload_env()
    clean_env.setenv(allocator.ALLOCATOR_VAR, "tcmalloc")
    clean_env.setattr(allocator, "tcmalloc_library", lambda: None)
    with pytest.raises(ValueError, match="no tcmalloc library found"):
        allocator.preload_env()


def test_rays_jemalloc_is_found_where_ray_is_installed():
    library = allocator.jemalloc_library()
    assert library is not None and library.endswith("ray/core/libjemalloc.so")


def test_the_callers_env_vars_win():
    assert with_env_vars({"env_vars": {"LD_PRELOAD": "x"}}, {"LD_PRELOAD": "y", "A": "1"}) == {
        "env_vars": {"LD_PRELOAD": "x", "A": "1"}}
    assert with_env_vars(None, {}) == {}
