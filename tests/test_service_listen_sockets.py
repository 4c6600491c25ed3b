"""The front ends' listening sockets (service/listen_sockets.py): by default on Linux each front end
listens on a socket of its own in one SO_REUSEPORT group, so the kernel spreads connections over
them; a killed front end's socket leaves the group at once (new connections are all served while it
restarts) and its restart listens on a new one; a second server on the same port is still refused;
FRONTEND_SOCKETS=shared keeps one socket for all. Real servers, their sockets read from /proc."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from live_server import REPO, start_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads on Linux")

FRONT_ENDS = 3


def _tcp_inodes(port: int, state: str) -> set[str]:
    """Socket inodes of the TCP sockets on local `port` in `state` (0A listen, 01 established)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == state and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(f[9])
    return found


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def _listening_by_front_end(srv) -> dict[int, set[str]]:
    """Front end 0 (the server process) and the further ones (spawned children that listen): the
    listening sockets each holds, all read against one reading of the port's listening sockets
    (a front end that starts listening between two readings would have none in the second)."""
    kids = [int(c) for task in Path(f"/proc/{srv.proc.pid}/task").iterdir()  # a restart is its watch thread's child
            for c in (task / "children").read_text().split()]
    listening = _tcp_inodes(srv.port, "0A")
    held = {pid: _socket_inodes(pid) & listening for pid in [srv.proc.pid, *kids]}
    return {pid: inodes for pid, inodes in held.items() if inodes or pid == srv.proc.pid}


def _wait_for(what, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.1)
    return value


def _second_server_is_refused(port: int) -> None:
    """`convserve serve` on `port` ends with the one-line "in use" error (it never joins the group)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    second = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--models", "tiny-vae"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2 and "is in use" in second.stderr, second.stderr


def test_each_front_end_listens_on_its_own_socket_and_the_connections_spread(tmp_path):
    srv = start_server(tmp_path, models="tiny-vae", cli_args=("--workers", str(FRONT_ENDS)))
    held = []
    try:
        # the further front ends listen once they can serve
        by_fe = _wait_for("front ends listening", lambda: (lambda m: m if len(m) == FRONT_ENDS else None)(
            _listening_by_front_end(srv)))
        assert all(len(inodes) == 1 for inodes in by_fe.values()), by_fe
        assert len(set().union(*by_fe.values())) == FRONT_ENDS, by_fe  # a socket each, not one shared
        # 60 kept connections: every front end takes some (a front end left none by the hash: 3 (2/3)^60)
        for _ in range(60):
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            held.append(sock)
        established = _tcp_inodes(srv.port, "01")
        counts = {pid: len(_socket_inodes(pid) & established) for pid in by_fe}
        assert sum(counts.values()) == 60 and min(counts.values()) > 0, counts

        # a front end killed: its socket leaves the group, so every new connection is served meanwhile
        victim = next(pid for pid in by_fe if pid != srv.proc.pid)
        os.kill(victim, signal.SIGKILL)
        _wait_for("the killed front end's socket gone", lambda: not (by_fe[victim] & _tcp_inodes(srv.port, "0A")))
        with httpx.Client(timeout=10) as client:
            for _ in range(30):
                client.headers["connection"] = "close"  # a new connection each
                assert client.get(f"{srv.url}/healthz").status_code == 200
        # ... and its restart listens on a new socket of its own
        again = _wait_for("the front end restarted", lambda: (lambda m: m if len(m) == FRONT_ENDS and victim not in m
                                                              else None)(_listening_by_front_end(srv)))
        assert len(set().union(*again.values())) == FRONT_ENDS, again
    finally:
        for sock in held:
            sock.close()
        assert srv.stop(timeout=30) == 0, srv.log()


def test_a_second_server_on_the_port_is_refused_and_shared_keeps_one_socket(tmp_path):
    srv = start_server(tmp_path, models="tiny-vae", cli_args=("--workers", "2"), frontend_sockets="shared")
    try:
        by_fe = _wait_for("front ends listening", lambda: (lambda m: m if len(m) == 2 else None)(
            _listening_by_front_end(srv)))
        assert len(set().union(*by_fe.values())) == 1, by_fe  # one socket, in both processes
        _second_server_is_refused(srv.port)
    finally:
        assert srv.stop(timeout=30) == 0, srv.log()


def test_a_second_server_cannot_join_a_servers_group(tmp_path):
    srv = start_server(tmp_path, models="tiny-vae", cli_args=("--workers", "2"))
    try:
        _second_server_is_refused(srv.port)
    finally:
        assert srv.stop(timeout=30) == 0, srv.log()


def test_a_front_ends_own_socket_joins_the_first_ones_group_and_falls_back_to_it(monkeypatch):
    """OwnSocketArgs: a new socket on the first one's port at each start, this process's copy
    closed once the child has it; where none can be bound, the first socket itself, never closed."""
    from service import listen_sockets

    first = listen_sockets.bind_first("127.0.0.1", 0, group=True)
    try:
        assert listen_sockets.in_group(first)
        make = lambda socks: ("settings", socks, 1)  # noqa: E731
        own = listen_sockets.OwnSocketArgs(first, make)
        args = own()
        (sock,) = args[1]
        assert sock is not first and sock.getsockname() == first.getsockname() and sock.get_inheritable()
        own.started()
        assert sock.fileno() == -1 and first.fileno() != -1

        def no_descriptors(_):
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(listen_sockets, "bind_sibling", no_descriptors)
        args = own()
        assert args[1] == [first]
        own.started()
        assert first.fileno() != -1
        with listen_sockets.bind_first("127.0.0.1", 0, group=False) as plain:
            assert not listen_sockets.in_group(plain)
    finally:
        first.close()
