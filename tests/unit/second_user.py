"""A second, real local user for the access tests: created with useradd (root only; CI runs
as root), removed after; ``as_user`` runs a function in a forked child that has really
become that user (uid, gid, no supplementary groups) and returns its JSON result."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def local_user(name: str) -> Iterator[pwd.struct_passwd]:
    """A system user ``name`` (no home, no shell) for the duration of the block."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("userdel"):
        pytest.fail("this test needs root and useradd/userdel to create a second local user "
                    "(CI runs as root); run it as root")
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell",
                    "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def as_user(user: pwd.struct_passwd, work: Callable[[], Any]) -> Any:
    """``work()`` in a forked child that has really become ``user``; its JSON result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            out = {"uid": os.getuid(), "euid": os.geteuid(), "result": work()}
            os.write(write, json.dumps(out).encode())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write, json.dumps({"error": repr(exc)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    out = json.loads(text or '{"error": "no answer"}')
    assert "error" not in out, out
    assert out["uid"] == out["euid"] == user.pw_uid != 0
    return out["result"]
