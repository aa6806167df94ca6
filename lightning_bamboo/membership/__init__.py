"""Membership: a small Store protocol, its embedded and etcd backends, and node registry helpers."""

from __future__ import annotations

from urllib.parse import urlsplit

from lightning_bamboo.membership.credentials import EtcdCredentials
from lightning_bamboo.membership.embedded import EmbeddedServer
from lightning_bamboo.membership.embedded_client import EmbeddedStore
from lightning_bamboo.membership.protocol import (
    DEFAULT_TIMEOUT,
    Change,
    Event,
    KeyValue,
    Lease,
    LeaseExpiredError,
    Snapshot,
    Store,
    StoreCredentialsError,
    StoreError,
    StorePermissionError,
    StoreTimeoutError,
    StoreUnavailableError,
    StoreURLError,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "Change",
    "EmbeddedServer",
    "EmbeddedStore",
    "Event",
    "KeyValue",
    "Lease",
    "LeaseExpiredError",
    "Snapshot",
    "Store",
    "StoreCredentialsError",
    "StoreError",
    "StorePermissionError",
    "StoreTimeoutError",
    "StoreURLError",
    "StoreUnavailableError",
    "connect",
    "parse_store_url",
    "resolve_store",
    "store_credentials",
]

_SCHEMES = ("embedded", "etcd")
_DEFAULT_PORTS = {"etcd": 2379}


def parse_store_url(url: str) -> tuple[str, str, int]:
    """Split ``embedded://HOST:PORT`` or ``etcd://HOST[:PORT][?cacert=...&cert=...&key=...&user=...]`` into
    ``(scheme, host, port)``; an etcd URL's query (its credentials, ``store_credentials``) is checked too."""
    if not isinstance(url, str) or "://" not in url:
        hint = (
            " ('embedded' alone is the launcher's choice: it starts EmbeddedServer() and hands its .url to workers)"
            if url == "embedded"
            else ""
        )
        raise StoreURLError(
            f"a store URL must look like embedded://HOST:PORT or etcd://HOST:PORT (got {url!r}){hint}"
        )
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise StoreURLError(
            f"unknown store backend {parts.scheme!r} in {url.partition('?')[0]!r}: use one of "
            + ", ".join(f"{s}://HOST:PORT" for s in _SCHEMES)
        )
    if parts.query and scheme == "etcd":
        EtcdCredentials.from_query(parts.query, url)  # before any message below can show the query
    url = url.partition("?")[0] + ("?..." if parts.query else "")
    if parts.username is not None or parts.password is not None:
        raise StoreURLError(f"a store URL names no user before its host (got {parts.hostname!r} with one); give an "
                            f"etcd user as {scheme}://HOST:PORT?user=NAME, its password in $ETCDCTL_PASSWORD or a "
                            "file named by password-file=PATH")
    if parts.path not in ("", "/") or (parts.query and scheme != "etcd") or parts.fragment:
        raise StoreURLError(f"a store URL has only a host and a port (got {url!r}); drop the path/query "
                            "(the embedded store takes no options: its token comes from $BAMBOO_STORE_TOKEN)")
    try:
        port = parts.port
    except ValueError as e:
        raise StoreURLError(f"bad port in store URL {url!r}: {e}; use a number in 1..65535") from e
    host = parts.hostname
    if not host:
        raise StoreURLError(f"store URL {url!r} has no host; e.g. {scheme}://127.0.0.1:2379")
    if port is None:
        if scheme not in _DEFAULT_PORTS:
            raise StoreURLError(f"store URL {url!r} needs a port: {scheme}://{host}:PORT")
        port = _DEFAULT_PORTS[scheme]
    return scheme, host, port


def store_credentials(url: str) -> EtcdCredentials:
    """The etcd credentials a store URL names (none for an embedded store's URL)."""
    return EtcdCredentials.from_query(urlsplit(url).query, url)


def connect(url: str, *, timeout: float = DEFAULT_TIMEOUT, request_timeout: float = DEFAULT_TIMEOUT) -> Store:
    """A connected ``Store`` for ``url``; raises ``StoreUnavailableError`` within ``timeout`` s if nobody answers,
    and ``StoreCredentialsError`` (in one line) when the store refuses this process's token or credentials.
    ``request_timeout``: the bound of each later call given no timeout (see ``Store``)."""
    scheme, host, port = parse_store_url(url)
    if scheme == "embedded":
        return EmbeddedStore(host, port, connect_timeout=timeout, request_timeout=request_timeout)
    from lightning_bamboo.membership.etcd import EtcdStore  # imports requests/etcd3gw only when asked

    return EtcdStore(host, port, connect_timeout=timeout, request_timeout=request_timeout,
                     credentials=store_credentials(url))


def resolve_store(spec: str) -> tuple[str, EmbeddedServer | None]:
    """Turn a launcher's ``--store`` value into the URL its workers connect to.

    ``"embedded"`` starts an ``EmbeddedServer`` on a free loopback port in this process and
    returns ``(its url, server)``: stop the server when the job ends. A URL is validated and
    returned as ``(url, None)``; it is not contacted here (call ``connect`` for that).
    """
    if spec == "embedded":
        server = EmbeddedServer().start()
        return server.url, server
    parse_store_url(spec)
    return spec, None
