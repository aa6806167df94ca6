"""Every pickle that crosses a process boundary, accounted for: where it comes from, and why that is the job's own.

The job trusts its own processes and the process groups' network (as torch.distributed does); it does not trust
the membership store or checkpoints from elsewhere (``docs/security.md``). So nothing read from the store is
unpickled (``test_store_values``, ``test_hostile_inputs``), and each place that does unpickle says why on its own
line (``# trusted: ...``), is listed in ``UNPICKLES`` below, and where it reads a socket, that socket can only lead
to a process of the job's own user: a ``socketpair`` end passed down by its parent (checked when the
communication process starts: ``comm_child.private_channel``), or the fork server's socket, which only its user can
open and whose peers are checked.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile

import pytest

from lightning_bamboo.engine.comm_child import UntrustedChannel, private_channel
from lightning_bamboo.launcher.forks import same_user
from tests.helpers import REPO

PACKAGE = REPO / "lightning_bamboo"
#: what unpickles (or names a pickle in a save: Lightning's ``weights_only=False`` flags are the grep's too)
UNPICKLING = re.compile(r"weights_only=False|pickle\.loads?\(|\.recv\(\)|_object(_list)?\(|ForkingPickler\.loads")
#: every such place, by file: (how many, where its data comes from)
UNPICKLES: dict[str, tuple[int, str]] = {
    "engine/comm_cuda.py": (1, "a CUDA IPC handle from its own worker, over private_channel"),
    "engine/comm_child.py": (3, "its worker's requests, over private_channel"),
    "engine/comm_process.py": (2, "its communication process, over a socketpair it made"),
    "engine/comm_zygote.py": (3, "its zygote and communication process, over socketpairs it made"),
    "engine/transfer.py": (1, "a rank of the job's own process group"),
    "runtime/stage.py": (1, "all_gather_object over the job's own process group"),
    "checkpoint.py": (3, "the job's own checkpoints, as Lightning loads them"),
    "callbacks/async_checkpoint.py": (1, "a save, no load"),
    "strategy/lightning_host.py": (1, "a save, no load"),
    "demo/worker.py": (1, "a save, no load"),
}
#: the modules of the communication process, which unpickle what their sockets carry
COMM_MODULES = ("engine/comm_process.py", "engine/comm_child.py", "engine/comm_zygote.py", "engine/comm_cuda.py")


def unpickling_lines() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if UNPICKLING.search(code):
                found.setdefault(str(path.relative_to(PACKAGE)), []).append(f"{number}: {line.strip()}")
    return found


def test_every_place_that_unpickles_is_listed_and_says_why_on_its_line():
    found = unpickling_lines()
    unexplained = [f"{file}:{line}" for file, lines in found.items() for line in lines if "trusted: " not in line.partition("#")[2]]
    assert not unexplained, ("a place that unpickles without its reason: say where its data comes from on its line "
                             "(# trusted: ...), or read JSON instead:\n" + "\n".join(unexplained))
    counts = {file: len(lines) for file, lines in found.items()}
    assert counts == {file: n for file, (n, _) in UNPICKLES.items()}, (
        "the places that unpickle changed; a new one is accounted for here (UNPICKLES) and in docs/security.md, "
        f"with why its data can only come from the job's own processes: {found}")


def test_nothing_the_store_holds_is_unpickled():
    """The modules that read the store (``membership/``) and the store collectives never unpickle."""
    found = unpickling_lines()
    assert not [file for file in found if file.startswith("membership/") or file == "runtime/collectives.py"]
    code = (PACKAGE / "runtime" / "collectives.py").read_text()
    assert "import pickle" not in code and "torch.load" not in code


def test_the_communication_process_talks_only_over_socketpairs():
    """No path or port a communication process unpickles from: its sockets are socketpairs (the process group's
    own TCPStore aside, which torch.distributed reads)."""
    for module in COMM_MODULES:
        code = "\n".join(line.split("#", 1)[0] for line in (PACKAGE / module).read_text().splitlines())
        for opening in (".bind(", ".listen(", "Listener(", "Client(", "AF_INET", "create_connection", ".connect("):
            assert opening not in code, f"{module} opens a socket others could reach ({opening})"


def test_a_communication_process_refuses_a_socket_that_could_lead_elsewhere(tmp_path):
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with mine, theirs:
        sock, conn = private_channel(os.dup(theirs.fileno()))  # its worker's socketpair: taken
        conn.close()
        sock.close()
    server = socket.create_server(("127.0.0.1", 0))
    with server, socket.create_connection(server.getsockname()) as tcp:
        with pytest.raises(UntrustedChannel, match=r"takes only an unnamed Unix socket to a process of its own user"):
            private_channel(os.dup(tcp.fileno()))
    with socket.socket(socket.AF_UNIX) as named, socket.socket(socket.AF_UNIX) as peer:
        named.bind(str(tmp_path / "comm.sock"))
        named.listen()
        peer.connect(str(tmp_path / "comm.sock"))
        with pytest.raises(UntrustedChannel, match="named: True"):
            private_channel(os.dup(peer.fileno()))


@pytest.mark.timeout(120)
def test_the_shared_fork_servers_socket_is_its_users_alone():
    """A request to the shared fork server runs a command: its socket is mode 0600, and a process of another user
    cannot connect (checked as root, where a child can become another user)."""
    from lightning_bamboo.launcher.forks import start_shared

    directory = tempfile.mkdtemp(prefix="bamboo-forks-")
    os.chmod(directory, 0o755)  # the directory is open: the socket's own mode must keep others out
    address = os.path.join(directory, "forks.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = start_shared(address, [], env)
    try:
        assert os.stat(address).st_mode & 0o777 == 0o600
        mine, theirs = socket.socketpair(socket.AF_UNIX)
        with mine, theirs:
            assert same_user(mine)
        if os.getuid() == 0:
            other = subprocess.run([sys.executable, "-c", (
                "import os, socket, sys\n"
                "os.setgid(65534); os.setuid(65534)\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "try:\n"
                f"    s.connect({address!r})\n"
                "except PermissionError:\n"
                "    sys.exit(13)\n")], capture_output=True, text=True, timeout=60)
            assert other.returncode == 13, other.stderr
    finally:
        proc.kill()
        proc.wait(30)
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
