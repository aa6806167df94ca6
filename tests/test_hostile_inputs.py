"""Hostile input: what someone other than the job's own processes could put in front of it, and what it does then.

- a store value made to run code when it is unpickled is refused, and runs nothing;
- the embedded store answers malformed, oversized and unknown requests with errors, and keeps serving the job;
  beyond loopback, every request without its shared token is refused;
- forged membership records (a node that never joined, a registration on another node's lease, a record that is
  not one) are ignored, each with a log line.

Real servers and sessions in this process; the attacker is a plain socket or a store client of its own.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_bamboo.membership import EmbeddedServer
from lightning_bamboo.runtime.collectives import StoreValueError, decode, encode
from tests.test_session_protocol import job, on_threads

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer() as running:
        yield running


class Payload:
    """Unpickled, it opens (creates) ``path``: the smallest thing a pickle can be made to do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        return open, (str(self.path), "w")


def pickled(obj: object) -> str:
    """``obj`` as the store values were once written: a torch.save pickle, in base64."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_a_store_value_made_to_run_code_when_unpickled_is_refused_and_runs_nothing(server, tmp_path):
    """Someone who can write under the job's prefix puts n1's part of the next collective before n1 does: n0 reads
    it in the real collective and refuses it; the file the pickle would create does not exist."""
    marker = tmp_path / "ran"
    with job(server, "hostile", ["n0", "n1"]) as s:
        attacker = s["n1"].store
        attacker.put(s["n0"].keys.coll(0, 0) + "/n/n1", pickled({"x": Payload(marker)}))
        parts = s["n0"].gather(encode({"x": 1}))  # the collective itself: n1's part is the attacker's
        assert decode(parts[0]) == {"x": 1}
        with pytest.raises(StoreValueError, match="it is not JSON") as err:
            decode(parts[1])
    assert not marker.exists(), "unpickling the store value ran its code"
    assert "nothing in it is unpickled or run" in str(err.value)


# ---------------------------------------------------------------------- the embedded store's requests
def ask(sock: socket.socket, reader: io.BufferedReader, line: bytes) -> dict:
    sock.sendall(line)
    return json.loads(reader.readline())


@pytest.mark.parametrize(("line", "error"), [
    (b"not json at all\n", r"^a request is one JSON object a line \(JSONDecodeError\)$"),
    (b"[1, 2, 3]\n", "a request is a JSON object, not a list"),
    (b'{"op": "exec", "code": "print(1)"}\n', "unknown op 'exec'"),
    (b'{"op": "__init__"}\n', "unknown op '__init__'"),
    (b'{"key": "/a"}\n', "unknown op 'None'"),
    (b'{"op": "put", "key": 7, "value": "x"}\n', "'put''s key is a string, not a int"),
    (b'{"op": "put", "key": "/a"}\n', r"'put' takes key, value, lease \(unknown: \[\], missing: \['value'\]\)"),
    (b'{"op": "get", "key": "/a", "shell": "rm -rf /"}\n', r"unknown: \['shell'\]"),
    (b'{"op": "grant", "ttl": NaN}\n', "'grant''s ttl is a finite number of seconds >= 0, not 'nan'"),
    (b'{"op": "keep_alive", "lease": -1}\n', "'keep_alive''s lease is a whole number >= 0, not '-1'"),
    (b'{"op": "put", "key": "/a", "value": "x", "guard": "anything"}\n', r"a guard is \[KEY, LEASE\]"),
    (b"[" * 100_000 + b"\n", r"^a request is one JSON object a line \(RecursionError\)$"),
])
def test_malformed_and_unknown_requests_get_errors_and_the_store_keeps_serving(line, error):
    from lightning_bamboo.membership import EmbeddedServer, connect

    with EmbeddedServer() as running:
        client = connect(running.url)
        try:
            client.put("/job/kept", "1")
            host, port = running.url.removeprefix("embedded://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as sock, sock.makefile("rb") as reader:
                resp = ask(sock, reader, line)
                assert resp["ok"] is False and resp["error"] == "bad_request", resp
                assert re.search(error, resp["message"]), resp["message"]
                # the same connection is still served, and so is the job's client
                assert ask(sock, reader, b'{"op": "get", "key": "/job/kept"}\n')["kv"]["value"] == "1"
            assert client.get("/job/kept").value == "1"
            assert [kv.key for kv in client.get_prefix("").kvs] == ["/job/kept"]  # nothing else was written
        finally:
            client.close()


def test_an_oversized_request_is_skipped_unread_and_the_store_keeps_serving():
    from lightning_bamboo.membership import EmbeddedServer, StoreError, connect
    from lightning_bamboo.membership.wire import MAX_REQUEST_BYTES

    with EmbeddedServer() as running:
        client = connect(running.url)
        try:
            host, port = running.url.removeprefix("embedded://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=30) as sock, sock.makefile("rb") as reader:
                huge = b'{"op": "put", "key": "/job/big", "value": "' + b"x" * (2 * MAX_REQUEST_BYTES) + b'"}\n'
                resp = ask(sock, reader, huge)
                assert resp == {"ok": False, "error": "bad_request",
                                "message": f"a request is at most {MAX_REQUEST_BYTES} bytes; this one was skipped unread"}
                # the rest of the line was skipped, not taken for a request: the connection serves the next one
                assert ask(sock, reader, b'{"op": "get", "key": "/job/big"}\n') == {"ok": True, "kv": None,
                                                                                    "revision": 1}
            assert client.get("/job/big") is None
            client.put("/job/small", "fine")
            assert client.get("/job/small").value == "fine"
            # the client says so before it sends one
            with pytest.raises(StoreError, match=f"over the embedded store's limit of {MAX_REQUEST_BYTES}"):
                client.put("/job/big", "x" * MAX_REQUEST_BYTES)
        finally:
            client.close()


# ---------------------------------------------------------------------- the embedded store's token
def test_beyond_loopback_the_embedded_store_refuses_to_start_without_a_token(monkeypatch):
    from lightning_bamboo.membership import EmbeddedServer, StoreCredentialsError
    from lightning_bamboo.membership.credentials import TOKEN_ENV

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(StoreCredentialsError, match=r"would listen on 0\.0\.0\.0, beyond loopback.*BAMBOO_STORE_TOKEN"):
        EmbeddedServer("0.0.0.0")
    EmbeddedServer("127.0.0.1").start().stop()  # loopback stays tokenless


def test_the_embedded_stores_command_refuses_beyond_loopback_in_one_line_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "BAMBOO_STORE_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "lightning_bamboo.membership.embedded", "--host", "0.0.0.0"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    (error,) = [line for line in proc.stderr.splitlines() if "error" in line]  # one line, no traceback
    assert error.startswith("python -m lightning_bamboo.membership.embedded: error: the embedded store would listen on "
                            "0.0.0.0, beyond loopback"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_with_a_token_every_request_without_it_is_refused_and_the_job_keeps_being_served(monkeypatch):
    from lightning_bamboo.membership import EmbeddedServer, StoreCredentialsError, connect
    from lightning_bamboo.membership.credentials import TOKEN_ENV

    monkeypatch.setenv(TOKEN_ENV, "s3cret-token")
    with EmbeddedServer("0.0.0.0") as running:
        port = int(running.url.rsplit(":", 1)[1])
        url = f"embedded://127.0.0.1:{port}"
        job = connect(url)  # with the token from the environment
        try:
            job.put("/job/nodes/n0", "member")
            for token in (None, "s3cret-tokeN", ""):
                if token is None:
                    monkeypatch.delenv(TOKEN_ENV)
                else:
                    monkeypatch.setenv(TOKEN_ENV, token)
                with pytest.raises(StoreCredentialsError, match="refused the request: this store needs its shared "
                                   "token in every request") as err:
                    connect(url)
                assert "s3cret" not in str(err.value)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, sock.makefile("rb") as reader:
                for line in (b'{"op": "delete_prefix", "prefix": ""}\n',
                             b'{"op": "put", "key": "/job/nodes/evil", "value": "x", "token": "guess"}\n',
                             b'{"op": "put", "key": "/job/nodes/evil", "value": "x", "token": 12}\n'):
                    assert ask(sock, reader, line)["error"] == "unauthorized"
            assert [kv.key for kv in job.get_prefix("/job/").kvs] == ["/job/nodes/n0"]  # nothing changed
            job.put("/job/nodes/n1", "member")  # and the job is served all along
            assert len(job.get_prefix("/job/").kvs) == 2
        finally:
            job.close()


# ---------------------------------------------------------------------- forged membership records
def test_forged_membership_records_are_ignored_each_with_a_log_line(server, caplog):
    """Beside a running job of n0 and n1, someone with write access puts: a registration of a node that never
    joined (on no lease), one on n0's lease, one that names n1's lease from a lease of its own, records that are not
    records, a loss notice naming another node than its key, a leave notice for n1 not on n1's lease, and a standby
    entry for its ghost. The membership is still n0 and n1, nobody leaves or is lost, nobody stands by; each forged
    record is logged once; the job's next step commits."""
    from lightning_bamboo.membership import connect

    with job(server, "forged", ["n0", "n1"]) as s:
        keys, n0, n1 = s["n0"].keys, s["n0"].registry, s["n1"].registry
        attacker = connect(server.url)
        own = attacker.grant_lease(30)

        def record(node: str, lease: int, **extra: object) -> str:
            return json.dumps({"node_id": node, "incarnation": "forged", "address": "", "host": "h", "pid": 1,
                               "meta": {}, "lease": lease, **extra})

        forged = {
            keys.node("ghost"): (record("ghost", 0), 0, "a registration on no lease: that node never joined"),
            keys.node("evil"): (record("evil", n0.lease_id), n0.lease_id, "which node n0 registered on: not its own"),
            keys.node("copy"): (record("copy", n1.lease_id), own.id, f"names lease {n1.lease_id} but is on lease"),
            keys.node("empty"): ("{}", own.id, "not those of a NodeInfo"),
            keys.node("list"): ("[1]", own.id, "a JSON list, not a record"),
            keys.node("text"): ("gASV", own.id, "not JSON"),
            keys.node("pid"): (record("pid", own.id, pid="1; rm -rf /"), own.id, "its pid is a str"),
            keys.lost("n1"): (json.dumps({"node_id": "n0", "incarnation": n0.info.incarnation, "reporter": "x",
                                          "reason": "forged"}), 0, "it names node 'n0', not 'n1'"),
            keys.leaving("n1"): (json.dumps({"node_id": "n1", "incarnation": n1.info.incarnation, "deadline": 0.0}),
                                 own.id, f"not on the lease of node n1 ({n1.lease_id})"),
        }
        with caplog.at_level(logging.WARNING, logger="lightning_bamboo.membership"):
            for key, (value, lease, _) in forged.items():
                attacker.put(key, value, lease=lease)
            attacker.put(keys.standby("ghost"), "1")
            for _ in range(3):  # read as the job reads it, again and again
                members = n0.members()
                assert members.live == ("n0", "n1") and set(members.nodes) == {"n0", "n1"}
                assert not members.lost and not members.leaving
            assert s["n0"].standby() == []
            assert on_threads({n: (lambda x=s[n]: x.commit(0)) for n in ("n0", "n1")}) == {"n0": None, "n1": None}
            assert s["n0"].leavers == set() and s["n1"].leavers == set()
            assert not s["n0"].detector.lost and not s["n1"].detector.lost
        attacker.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_bamboo.membership.members"]
    for key, (_, _, why) in forged.items():
        about = [line for line in lines if line.startswith(f"membership: ignored {key} ")]
        assert len(about) == 1, (key, about)  # once, however often the membership is read
        assert why in about[0] and "docs/security.md" in about[0], about[0]
    assert len(lines) == len(forged), lines


def test_a_shared_buffer_offer_made_to_run_code_is_not_taken_and_runs_nothing(tmp_path, caplog):
    """The replica holder's offer of its shared gradient buffer comes over the process group; it is JSON now. An
    offer made to run code when unpickled (as the offers once were) is not taken, and runs nothing."""
    import pickle

    from lightning_bamboo.engine.shared_buffer import map_offered_buffer

    marker = tmp_path / "ran"
    with caplog.at_level(logging.WARNING, logger="lightning_bamboo.engine.shared_buffer"):
        assert map_offered_buffer(pickle.dumps(Payload(marker)), 1000) is None
        assert map_offered_buffer(b'["host", 1, 2, -3, 1000]', 1000) is None
    assert not marker.exists(), "unpickling the offer ran its code"
    assert caplog.text.count("the replica holder's offer of a shared buffer is not one: not taken") == 2


def test_a_restart_loads_no_checkpoint_the_store_names_unless_the_node_knows_it_as_the_jobs(tmp_path):
    """The survivors of a fatal loss agree through the store on the checkpoint to resume from. A path put there by
    anyone else (a file it made, to be loaded with pickle) is refused; the job's own checkpoint is taken."""
    from lightning_bamboo.errors import BambooError
    from lightning_bamboo.runtime.restart import known_checkpoint

    ours = [(10, str(tmp_path / "checkpoints" / "step-00000010")), (20, str(tmp_path / "checkpoints" / "step-00000020"))]
    assert known_checkpoint({"step": 20, "path": ours[1][1]}, lambda: ours) == ours[1]
    assert known_checkpoint({"step": None, "path": None}, lambda: ours) is None
    forged = {"step": 99, "path": str(tmp_path / "elsewhere" / "step-00000099")}
    with pytest.raises(BambooError, match="is not one this node knows of .* it is not loaded"):
        known_checkpoint(forged, lambda: ours)
    with pytest.raises(BambooError, match="is not one this node knows of"):  # a known path, a forged step: the path
        known_checkpoint({"step": 20, "path": str(tmp_path / "step-00000020")}, lambda: ours)
