"""Where ``tandem drain`` and ``tandem scale`` find a ``tandem serve`` running on this machine.

The Ray that ``tandem serve`` starts listens on loopback only (``ray_start``), where Ray's
own ``address="auto"`` does not look (it joins the host's network address), and Ray turns
on token authentication for it. So each running ``tandem serve`` records, in a
per-user runtime folder, a small file about itself: its Ray address, its gateway's
control name, its HTTP host and port, its process id and where its Ray token comes from.
``find`` reads them back, skipping those of processes that are gone; ``RayRuntime``
joins the one picked with ``ray_env`` set.

The folder is ``$XDG_RUNTIME_DIR/tandem``, else ``run-<uid>`` in the tandem cache dir;
it is private to its user (mode 0700, files 0600), and a file lives as long as its serve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tandem.common.cache_dir import cache_dir

log = logging.getLogger(__name__)
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


@dataclasses.dataclass(frozen=True)
class LocalServe:
    """One running ``tandem serve``, as it recorded itself.

    ``control_name``: the gateway's name in the Ray key-value store (``control``);
    ``deployment``: its ``--deployment``, if any. ``token_auth``: its Ray wants a token,
    read from ``token_path``, or (``token_path`` None) given by ``$RAY_AUTH_TOKEN``.
    """

    pid: int
    ray_address: str
    control_name: str
    deployment: str | None
    host: str
    port: int
    token_auth: bool = False
    token_path: str | None = None
    hostname: str = dataclasses.field(default_factory=socket.gethostname)

    def describe(self) -> str:
        """One line naming it: how to pick it, and its process."""
        name = f"deployment {self.deployment}" if self.deployment else f"gateway {self.control_name}"
        return f"port {self.port}, {name}, pid {self.pid}"

    def ray_env(self) -> dict[str, str | None]:
        """The environment that joins its Ray (``None``: unset): the token, where it
        wants one. Raises ``ValueError`` when the token is only in its environment and
        not in this one."""
        if not self.token_auth:
            return {}
        if self.token_path is not None:  # $RAY_AUTH_TOKEN would take precedence over the file
            return {AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: self.token_path, TOKEN_ENV: None}
        if not os.environ.get(TOKEN_ENV):
            raise ValueError(f"the tandem serve at {self.describe()} joins Ray with the token "
                             f"in ${TOKEN_ENV}: set it for this command too")
        return {AUTH_MODE_ENV: "token"}


def runtime_dir() -> Path:
    """The folder of this user's records (not created here)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "tandem" if xdg else cache_dir() / f"run-{os.getuid()}"


def ray_token_source() -> tuple[bool, str | None]:
    """``(token_auth, token_path)`` of the Ray this process has joined: whether it wants
    a token and the file it comes from (None: from ``$RAY_AUTH_TOKEN``, or no token)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        token_auth = is_token_auth_enabled()
    except ImportError:  # a Ray without token authentication
        token_auth = os.environ.get(AUTH_MODE_ENV, "").lower() == "token"
    if not token_auth or os.environ.get(TOKEN_ENV):
        return token_auth, None
    path = os.environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token"
    return True, os.path.abspath(path)


def _record_path(pid: int) -> Path:
    return runtime_dir() / f"serve-{pid}.json"


@contextlib.contextmanager
def recorded(serve: LocalServe) -> Iterator[Path | None]:
    """Keep ``serve``'s record while the block runs (best effort: a record that cannot be
    written is logged, and yields None)."""
    path = _record_path(serve.pid)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".serve-", dir=path.parent)  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(serve), f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot record this serve for `tandem drain` in %s: %s", path.parent, e)
        yield None
        return
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def live() -> list[LocalServe]:
    """The serves running on this machine, by port; records of ended processes are removed."""
    try:
        paths = sorted(runtime_dir().glob("serve-*.json"))
    except OSError:
        return []
    here, found = socket.gethostname(), []
    for path in paths:
        try:
            serve = LocalServe(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours to read
        if serve.hostname != here:  # a folder shared with another machine or container
            continue
        if not _alive(serve.pid):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        found.append(serve)
    return sorted(found, key=lambda s: (s.port, s.pid))


def find(deployment: str | None = None, port: int | None = None) -> LocalServe | None:
    """The running serve to talk to: the only one, or the one ``deployment`` (its
    ``--deployment`` or gateway name) and ``port`` (its ``--port``) pick. None when none
    runs here. Raises ``ValueError`` when several fit, or none of those running does."""
    serves = live()
    if not serves:
        if port is not None:
            raise ValueError(f"no tandem serve runs on this machine (looked for --port {port})")
        return None
    fit = [s for s in serves
           if (deployment is None or deployment in (s.deployment, s.control_name))
           and (port is None or s.port == port)]
    if len(fit) == 1:
        return fit[0]
    if not fit:
        running = "; ".join(s.describe() for s in serves)
        asked = " and ".join(f for f in (deployment and f"--deployment {deployment}",
                                         port is not None and f"--port {port}") if f)
        raise ValueError(f"no tandem serve on this machine has {asked} (running: {running}); "
                         "a Ray cluster elsewhere: --ray-address")
    running = "; ".join(s.describe() for s in fit)
    raise ValueError(f"{len(fit)} tandem serves run on this machine ({running}): "
                     "pick one with --deployment NAME or --port PORT")
