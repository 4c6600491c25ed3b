"""`.npy` answers leave the server straight from shared memory (service/frontend/routes/
arena_response.py, and a whole clip's float32 groups): their blocks must not go back to the
arena until every byte has left. uvloop keeps the unsent tail of a view by reference, so a block
freed after the last `send` is reused by the next request, whose output would then be sent to
the first client in place of its own (service/frontend/http/sent.py).

A real server (httptools + uvloop, the default) and a client that asks for a 7 MB decode (an
image, and a video clip sent group by group) with a small receive buffer and reads nothing while
other requests of the same shape come and go; what it reads afterwards must be its own decode,
byte for byte. And the pieces: the write-buffer
wait on a real uvloop connection, and leases let go in the order their bytes leave."""
from __future__ import annotations

import asyncio
import socket
import time

import httpx
import numpy as np
import pytest

from live_server import from_npy, npy

from service.frontend.http.sent import HeldUntilSent, Sent, sendable

#: 7 MiB of float32 answer each: tiny-vae 96x96 latents -> 768x768x3; tiny-wan-vae 3x32x32 -> 9x256x256x3
CASES = [("tiny-vae", (1, 4, 96, 96), (1, 768, 768, 3)), ("tiny-wan-vae", (1, 4, 3, 32, 32), (1, 9, 256, 256, 3))]


def _slow_request(port: int, model: str, body: bytes) -> socket.socket:
    """A decode asked on a socket whose receive buffer is small and which reads nothing yet."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    s.connect(("127.0.0.1", port))
    head = (f"POST /v1/models/{model}/decode?format=npy HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-npy\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    s.sendall(head + body)
    return s


def _read_all(s: socket.socket) -> bytes:
    s.settimeout(60)
    chunks = []
    while True:
        data = s.recv(1 << 20)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(max_queue_delay_ms=0)


@pytest.mark.parametrize("model,latent_shape,out_shape", CASES, ids=[c[0] for c in CASES])
def test_a_slow_reader_gets_its_own_npy_while_its_blocks_would_be_reused(srv, model, latent_shape, out_shape):
    rng = np.random.default_rng(20261129)
    mine, others = (rng.standard_normal(latent_shape).astype(np.float32) for _ in range(2))
    path = f"/v1/models/{model}/decode?format=npy"
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        expected = c.post(path, content=npy(mine)).content
        slow = _slow_request(srv.port, model, npy(mine))
        try:
            time.sleep(0.5)  # its decode starts; its answer waits on the socket, mostly unsent
            for _ in range(2):  # requests of the same shape, in the blocks first fit hands out
                r = c.post(path, content=npy(others))
                assert r.status_code == 200
                assert r.content != expected  # the check below can tell the two apart
            raw = _read_all(slow)
        finally:
            slow.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert len(body) == len(expected)
    assert body == expected, "the slow reader was sent bytes of another request"
    assert from_npy(body).shape == out_shape


def test_the_write_buffer_wait_ends_when_the_reader_has_read():
    uvloop = pytest.importorskip("uvloop")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def read_all(conn: socket.socket) -> bytes:
        return _read_all(conn)

    async def main():
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", listener.getsockname()[1])
        peer, _ = listener.accept()  # reads nothing until told
        block = np.full(32 << 20, 1, np.uint8)
        transport.write(memoryview(block))
        sent = Sent(transport)
        assert sent.pending() > 0  # held by reference: the reader has not read
        waiting = asyncio.ensure_future(sent.wait())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        reading = loop.run_in_executor(None, read_all, peer)
        await asyncio.wait_for(waiting, 30)
        block[:] = 2  # reused only now: every byte had left
        transport.close()
        got = await asyncio.wait_for(reading, 30)
        peer.close()
        return np.frombuffer(got, np.uint8)

    try:
        out = uvloop.run(main())
    finally:
        listener.close()
    assert out.size == 32 << 20 and (out == 1).all()


class _Buffer:
    def __init__(self):
        self.size = 0

    def get_write_buffer_size(self):
        return self.size


class _Lease:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def close(self):
        self.log.append(self.name)


def test_leases_go_back_as_their_bytes_leave():
    buf, log = _Buffer(), []
    held = HeldUntilSent(Sent(buf))
    held.wrote(100)
    buf.size = 100
    held.hold(_Lease("a", log))  # all 100 bytes still queued
    held.wrote(50)
    buf.size = 120  # 30 of a's bytes have left
    held.hold(_Lease("b", log))
    assert log == []
    buf.size = 50  # a's 100 bytes have left, b's 50 not
    held.release_sent()
    assert log == ["a"]
    buf.size = 0
    asyncio.run(held.drain())
    assert log == ["a", "b"]
    held.hold(_Lease("c", log))  # nothing queued: at once
    assert log == ["a", "b", "c"]


def test_without_the_extension_views_are_copied():
    block = np.arange(10, dtype=np.uint8)
    part = sendable(memoryview(block), None)
    block[:] = 0
    assert isinstance(part, bytes) and part == bytes(range(10))
    view = memoryview(block)
    assert sendable(view, Sent(_Buffer())) is view
