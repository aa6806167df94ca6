"""A node's address and the network interface that owns it: process groups bind there, never to what the host name resolves to."""

from __future__ import annotations

import ipaddress
import socket

from lightning_bamboo.errors import BambooConfigError


class AddressError(BambooConfigError):
    """``--addr`` is not an IP address this machine owns."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and binds to port 0 (Linux's default where unknown)."""
    try:
        low, high = (int(v) for v in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a server that binds it later (a process group's store, etcd).

    Drawn below the kernel's ephemeral range, where no outgoing connection takes its source port: a port the kernel
    picks for a bind to 0 comes from that range, and on a busy machine (gloo's connections, store clients) another
    process's connection took it between the pick and the server's bind, and the job's process group never formed.
    Falls back to the kernel's pick if no port there is free after a few tries.
    """
    import random

    low, _high = ephemeral_range()
    start = 10000 if low > 20000 else 1024
    # the system's randomness: a process seeded as the job's others are (seed_everything) draws other ports
    for port in random.SystemRandom().sample(range(start, low), k=min(64, max(low - start, 0))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def local_addresses() -> dict[str, list[str]]:
    """Every IPv4/IPv6 address of this machine, by interface (link-local scopes dropped)."""
    import psutil

    found: dict[str, list[str]] = {}
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                found.setdefault(name, []).append(entry.address.split("%", 1)[0])
    return found


def _describe(addresses: dict[str, list[str]]) -> str:
    return "; ".join(f"{name} {', '.join(addrs)}" for name, addrs in sorted(addresses.items())) or "none"


def interface_for(addr: str) -> str:
    """The name of the interface that owns ``addr`` (an IP literal); ``AddressError`` if none does.

    A loopback address that is not configured itself (``127.0.0.2``) belongs to the loopback
    interface, as Linux routes all of ``127.0.0.0/8`` there.
    """
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        raise AddressError(
            f"--addr must be an IP address, not a host name (got {addr!r}): peers connect to it without DNS; pass "
            f"this machine's address on the network its peers share, one of: {_describe(local_addresses())}"
        ) from None
    addresses = local_addresses()
    for name, addrs in sorted(addresses.items()):
        if any(ipaddress.ip_address(a) == ip for a in addrs):
            return name
    if ip.is_loopback:
        for name, addrs in sorted(addresses.items()):
            if any(ipaddress.ip_address(a).is_loopback and ipaddress.ip_address(a).version == ip.version for a in addrs):
                return name
    raise AddressError(
        f"--addr {addr} is not an address of this machine ({socket.gethostname()}), whose addresses are: "
        f"{_describe(addresses)}; pass the one its peers reach it at (the job's process groups bind to the interface "
        "that owns it)"
    )


def source_address(host: str, port: int) -> str:
    """The address this machine sends from to reach ``host:port``: the kernel's route, no packet sent.

    What ``--addr auto`` means: the interface that reaches the store reaches the peers too on a
    flat network (one VPC, one cluster network); on another one pass the address itself.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as err:
        raise AddressError(f"--addr auto: cannot resolve the store's host {host!r} ({err}); pass --addr with this "
                           f"machine's address, one of: {_describe(local_addresses())}") from None
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(sockaddr)
        except OSError as err:
            raise AddressError(f"--addr auto: no route from this machine to the store at {host}:{port} ({err}); pass "
                               f"--addr with this machine's address, one of: {_describe(local_addresses())}") from None
        return str(probe.getsockname()[0])


def bind_env(addr: str) -> dict[str, str]:
    """The environment that binds a worker's process groups (gloo, NCCL) to the interface that owns ``addr``."""
    interface = interface_for(addr)
    # NCCL matches interface names by prefix unless the name starts with "="
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": f"={interface}"}
