"""Token auth setup (eyas_ray.auth, eyas_ray.cluster): created when missing, never turned off, clear when absent."""
from __future__ import annotations

import re
import stat

import pytest

from eyas_ray import auth
from eyas_ray.cluster import init_ray


@pytest.fixture()
def empty_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in (auth.TOKEN, auth.TOKEN_PATH, auth.AUTH_MODE, "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return home


def test_token_file_is_private_and_like_rays_own(tmp_path):
    path = auth.write_token_file(tmp_path / "deep" / "auth_token")
    assert re.fullmatch(r"[0-9a-f]{64}", path.read_text())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["auth_token"]  # no partial file left behind
    assert auth.write_token_file(path).read_text() != auth.write_token_file(path).read_text()


def test_a_fresh_home_gets_a_user_token_once(empty_home, capsys):
    source = auth.ensure_user_token()
    assert source == str(empty_home / ".ray" / "auth_token")
    token = (empty_home / ".ray" / "auth_token").read_text()
    assert "created a Ray auth token" in capsys.readouterr().out
    assert auth.ensure_user_token() == source
    assert (empty_home / ".ray" / "auth_token").read_text() == token  # an existing token is never replaced
    assert capsys.readouterr().out == ""


def test_token_sources_in_rays_order(empty_home, tmp_path):
    assert auth.token_source({}) is None
    own = auth.write_token_file(tmp_path / "own")
    assert auth.token_source({auth.TOKEN_PATH: str(own)}) == str(own)
    assert auth.token_source({auth.TOKEN: "abc", auth.TOKEN_PATH: str(own)}) == auth.TOKEN
    with pytest.raises(RuntimeError, match="RAY_AUTH_TOKEN_PATH=.*missing or empty"):
        auth.token_source({auth.TOKEN_PATH: str(tmp_path / "absent")})


def test_ensure_user_token_respects_an_explicit_token_path(empty_home, tmp_path, monkeypatch):
    own = auth.write_token_file(tmp_path / "own")
    monkeypatch.setenv(auth.TOKEN_PATH, str(own))
    assert auth.ensure_user_token() == str(own)
    assert not (empty_home / ".ray").exists()


def test_token_env_switches_auth_on_and_keeps_the_rest():
    env = auth.token_env({"A": "1", auth.AUTH_MODE: "disabled"})
    assert env == {"A": "1", auth.AUTH_MODE: "token"}


def test_joining_a_cluster_without_any_token_says_how_to_get_one(empty_home, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(RuntimeError, match=r"no Ray auth token was found.*auth_token"):
        init_ray()
