"""``tandem serve`` as a subprocess for the benchmarks: start on a free port, wait for
``/ready``, stop cleanly (SIGTERM, then SIGKILL to its process group) even on errors.

    with TandemServer(model, mode="colocated", prefill_workers=0, decode_workers=2) as srv:
        ... srv.url ...
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.client import wait_ready


class TandemServer:
    """One ``python -m tandem.cli.main serve`` process in its own session.

    Its output goes to ``log_path`` (default: a temporary file), whose tail is in the
    error if it fails to start.
    """

    def __init__(self, model: str, *, mode: str = "disaggregated", prefill_workers: int = 1,
                 decode_workers: int = 1, threads_per_worker: int = 1, served_model_name: str = "bench",
                 extra_args: Sequence[str] = (), log_path: str | Path | None = None,
                 startup_timeout_s: float = 300.0) -> None:
        from tandem.gateway.server import find_free_port

        self.model = model
        self.mode, self.prefill_workers, self.decode_workers = mode, prefill_workers, decode_workers
        self.threads_per_worker = threads_per_worker
        self.served_model_name = served_model_name
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "tandem.cli.main", "serve", "--model", model,
                     "--served-model-name", served_model_name, "--mode", mode,
                     "--prefill-workers", str(prefill_workers), "--decode-workers", str(decode_workers),
                     "--threads-per-worker", str(threads_per_worker), "--port", str(self.port),
                     # a benchmark's pools are what it says; extra_args may turn bursts on
                     "--decode-burst-threads", "0", "--prefill-burst-threads", "0", *extra_args]
        self._own_log = log_path is None  # a temporary log, removed after a clean stop
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="tandem-serve-",
                                                                             suffix=".log")[1])
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def describe(self) -> dict:
        """Mode and pool sizes as configured (for the results' metadata)."""
        pools = ({"both": self.prefill_workers + self.decode_workers} if self.mode == "colocated"
                 else {"prefill": self.prefill_workers, "decode": self.decode_workers})
        return {"mode": self.mode, "pools": pools, "threads_per_worker": self.threads_per_worker,
                "command": " ".join(self.argv[1:])}

    def start(self) -> TandemServer:
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child keeps writing to it
        try:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         start_new_session=True)
        finally:
            log.close()
        try:
            wait_ready(self.url, self.proc, self.startup_timeout_s)
        except BaseException as e:
            tail = self.log_tail()
            self._own_log = False  # keep it for the post-mortem
            self.stop()
            raise RuntimeError(f"tandem serve ({self.mode}) did not become ready: {e}\n"
                               f"--- last lines of {self.log_path} ---\n{tail}") from e
        return self

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the server drains and shuts its cluster down), then SIGKILL its process group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever it left behind in its session (it was started with start_new_session)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None
        if self._own_log and code == 0:
            self.log_path.unlink(missing_ok=True)
        return code

    def __enter__(self) -> TandemServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
