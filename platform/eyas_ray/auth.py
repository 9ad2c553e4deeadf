"""Ray 2.60 token auth, set up so that it is always on and never depends on what an earlier run left behind.

Two kinds of cluster, two places for the token:
- **A user's own cluster** (``ray start --head`` by hand, ``ray up cluster.yaml``): the token is the user's
  ``~/.ray/auth_token``, the file Ray's own CLI reads and ``ray get-auth-token --generate`` writes. eyas creates it
  when it is missing (:func:`ensure_user_token`), so a new machine just works.
- **A throwaway head** (``make demo``, the tests): a token file of its own inside the head's temp dir, named to
  every process through ``RAY_AUTH_TOKEN_PATH`` (:func:`write_token_file`). It never reads or writes ``~/.ray``
  and disappears with the head.

Every process that starts or joins a cluster runs with ``RAY_AUTH_MODE=token`` (:func:`token_env`). Ray itself
then refuses callers without the token; nothing here ever turns auth off.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Mapping

AUTH_MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
NUM_TOKEN_BYTES = 32  # as Ray's own generator: 256 bits, written as 64 hex characters


def user_token_file() -> Path:
    """Where Ray's CLI looks for the token of a user's own cluster (read at call time: HOME may change)."""
    return Path.home() / ".ray" / "auth_token"


def write_token_file(path: Path) -> Path:
    """A new random token in ``path`` (mode 0600), written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(NUM_TOKEN_BYTES))
    os.replace(partial, path)
    return path


def token_source(env: Mapping[str, str] | None = None) -> str | None:
    """Where this process's token comes from (the variable or the file), or None when there is none."""
    env = os.environ if env is None else env
    if env.get(TOKEN):
        return TOKEN
    if env.get(TOKEN_PATH):
        path = Path(env[TOKEN_PATH]).expanduser()
        if not path.is_file() or not path.read_text().strip():
            raise RuntimeError(f"{TOKEN_PATH}={path}: the file is missing or empty; unset {TOKEN_PATH} to use "
                               f"{user_token_file()}, or write a token there (`ray get-auth-token --generate` "
                               f"writes {user_token_file()})")
        return str(path)
    return str(user_token_file()) if user_token_file().is_file() else None


def ensure_user_token() -> str:
    """The token source for a user's own cluster, creating ``~/.ray/auth_token`` when there is none at all."""
    source = token_source()
    if source is None:
        source = str(write_token_file(user_token_file()))
        print(f"[eyas] created a Ray auth token in {source} (what `ray get-auth-token --generate` does); every "
              "node and client of your cluster needs this same token", flush=True)
    return source


def token_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with token auth switched on; the token itself must be set up already."""
    return {**(os.environ if env is None else env), AUTH_MODE: "token"}
