"""Where a membership store's secrets come from: the environment or files, never the command line or a log line.

The embedded store's shared token is ``$BAMBOO_STORE_TOKEN``. etcd's credentials follow etcdctl's own names: the
store URL's ``cacert``, ``cert``, ``key`` and ``user`` (``etcd://HOST:PORT?cacert=ca.pem&cert=c.pem&key=k.pem&user=
NAME``: paths and a name, no secret), the launcher's ``--cacert``, ``--cert``, ``--key`` and ``--user``; the user's
password from ``$ETCDCTL_PASSWORD`` (etcdctl's variable) or from the file that ``password-file`` names.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from urllib.parse import parse_qsl, urlencode

from lightning_bamboo.membership.protocol import StoreCredentialsError, StoreURLError

#: the embedded store's shared token (a server beyond loopback refuses to start without one)
TOKEN_ENV = "BAMBOO_STORE_TOKEN"
#: an etcd user's password, under etcdctl's own name for it
PASSWORD_ENV = "ETCDCTL_PASSWORD"
#: how to make a token, for the messages that ask for one
MAKE_TOKEN = f"export {TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')"


def store_token(env: Mapping[str, str] | None = None) -> str | None:
    """The embedded store's shared token from the environment; None when unset or empty."""
    return (os.environ if env is None else env).get(TOKEN_ENV) or None


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1): only this machine reaches it."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


@dataclass(frozen=True)
class EtcdCredentials:
    """How to reach an etcd as it is deployed: TLS (``cacert``: the CA that signed etcd's certificate; ``cert`` and
    ``key``: a client certificate) and an etcd ``user``, whose password is read at connection time (``password``).
    Nothing here is secret: it goes in the store URL, which workers inherit and messages name."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise StoreURLError(f"a client certificate needs both cert= and key= (got cert={self.cert!r}, "
                                f"key={self.key!r}); give both, as etcdctl's --cert and --key")
        if self.user is not None and (":" in self.user or not self.user):
            raise StoreURLError(
                "user= names an etcd user, without a password (etcdctl's --user=NAME:PASSWORD puts it on the command "
                f"line, where every process sees it); give user=NAME and the password in ${PASSWORD_ENV} or a file "
                "named by password-file=PATH")
        if self.password_file is not None and self.user is None:
            raise StoreURLError("password-file= goes with user=NAME (the etcd user it is the password of)")

    @property
    def tls(self) -> bool:
        """Whether the store is reached over TLS (a CA or a client certificate given)."""
        return self.cacert is not None or self.cert is not None

    @classmethod
    def from_query(cls, query: str, url: str) -> EtcdCredentials:
        """The credentials a store URL's query names (``cacert=...&user=...``); refuses anything else."""
        names = {f.name.replace("_", "-"): f.name for f in fields(cls)}
        given: dict[str, str] = {}
        for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
            if name in ("password", "pass", "token"):
                raise StoreURLError(
                    f"a store URL never holds a password ({name}= in {_without_query(url)}?...): the URL is on "
                    f"command lines and in logs; put the password in ${PASSWORD_ENV} or in a file named by "
                    "password-file=PATH")
            if name not in names:
                raise StoreURLError(f"unknown store URL option {name[:40]!r} in {_without_query(url)}?...: an etcd URL "
                                    f"takes {', '.join(names)} (etcdctl's names)")
            if name in given or not value:
                raise StoreURLError(f"store URL option {name}= is empty or given twice in {_without_query(url)}?...")
            given[names[name]] = value
        return cls(**given)

    def query(self) -> str:
        """These credentials as a store URL's query (empty when there are none)."""
        return urlencode([(f.name.replace("_", "-"), getattr(self, f.name)) for f in fields(self)
                          if getattr(self, f.name) is not None], safe="/")

    def check_files(self, url: str) -> None:
        """Every file named is there and readable (a clear error now, not a TLS error later)."""
        for f in fields(self):
            path = getattr(self, f.name)
            if f.name != "user" and path is not None and not os.access(path, os.R_OK):
                why = "does not exist" if not os.path.exists(path) else "is not readable by this user"
                raise StoreCredentialsError(f"{f.name.replace('_', '-')}={path} for {url} {why}; give the path of "
                                            "a readable file (an absolute path: workers may run elsewhere)")

    def password(self, url: str, env: Mapping[str, str] | None = None) -> str:
        """The user's password: from ``password_file``, else ``$ETCDCTL_PASSWORD``. Never put in a message."""
        if self.password_file is not None:
            try:
                with open(self.password_file, encoding="utf-8") as f:
                    return f.read().rstrip("\r\n")
            except OSError as err:
                raise StoreCredentialsError(f"password-file={self.password_file} for {url} cannot be read "
                                            f"({err.strerror}); give a file this user can read") from None
        password = (os.environ if env is None else env).get(PASSWORD_ENV)
        if not password:
            raise StoreCredentialsError(
                f"etcd user {self.user!r} for {url} needs a password and none was given: put it in ${PASSWORD_ENV} "
                "(etcdctl's variable) or in a file named by password-file=PATH (--password-file); never on the "
                "command line")
        return password


def with_credentials(url: str, **options: str | None) -> str:
    """``url`` with the launcher's credential options (``cacert=``, ``cert=``, ``key=``, ``user=``,
    ``password_file=``) added to its query, paths made absolute (workers may start in another directory)."""
    base, _, query = url.partition("?")
    merged = dict(parse_qsl(query))
    for name, value in options.items():
        if value is None:
            continue
        key = name.replace("_", "-")
        if key in merged and merged[key] != value:
            raise StoreURLError(f"--{key} {value} and the store URL's {key}={merged[key]} differ; give it once")
        merged[key] = value if name == "user" else os.path.abspath(value)
    if not merged:
        return url
    credentials = EtcdCredentials.from_query(urlencode(merged), url)
    return f"{base}?{credentials.query()}"


def _without_query(url: str) -> str:
    return url.partition("?")[0]
