"""Bad HTTP input drill (issue 9, drill 7): malformed requests, huge headers,
slow clients and seeded random bytes against a real exporter process that
serves two synthetic ranks. The exporter must never crash or hang, must
close every bad connection within a bounded time, and must keep serving
valid scrapes throughout.
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rankscope.exporter.server import HEADER_DEADLINE_S, SOCKET_TIMEOUT_S
from tests.helpers.exporter_proc import ExporterProcess, SyntheticRanks
from tests.helpers.jobs import scrape, select, wait_until

FUZZ_SEED = 9
FUZZ_CASES = 600
# A bad connection is answered or closed within this long: the per-read
# timeout (a client that sends part of a request and waits), plus slack for a
# loaded 2-core machine.
CLOSE_WITHIN_S = SOCKET_TIMEOUT_S + 5


@pytest.fixture(scope="module")
def exporter(tmp_path_factory):
    metrics_dir = tmp_path_factory.mktemp("fuzz") / "metrics"
    metrics_dir.mkdir()
    with SyntheticRanks(metrics_dir, n=2), ExporterProcess(metrics_dir) as exp:
        wait_until(lambda: len(select(scrape(exp.url), "rankscope_rank_up")) == 2, 30, what="2 synthetic ranks")
        yield exp
        assert exp.proc.poll() is None, "the exporter died"


def exchange(port: int, payload: bytes, half_close: bool = True, limit_s: float = CLOSE_WITHIN_S) -> tuple[bytes, float]:
    """Send ``payload``, read until the server closes; returns (reply, seconds).
    Fails if the server keeps the connection open longer than ``limit_s``."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        try:
            s.sendall(payload)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:   # the server may close first (request too large)
            pass
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        except socket.timeout:
            raise AssertionError(f"server held a bad connection open for {limit_s} s: {payload[:80]!r}")
    return b"".join(chunks), time.monotonic() - t0


def is_http_reply(reply: bytes) -> bool:
    """Nothing (closed) or an HTTP/1.x response with a status line (the
    exporter refuses HTTP/0.9, whose responses have none)."""
    return reply == b"" or re.match(rb"HTTP/1\.[01] [1-5]\d\d ", reply) is not None


def assert_valid_scrape(exp: ExporterProcess) -> None:
    samples = scrape(exp.url, timeout=10)
    assert len(select(samples, "rankscope_rank_up")) == 2
    assert exp.proc.poll() is None


MALFORMED = {
    "garbage line": b"GARBAGE\r\n\r\n",
    "method only": b"GET\r\n\r\n",
    "bad version": b"GET /metrics HTTP/9.9\r\n\r\n",
    "bad version text": b"GET /metrics HTTP/x.y\r\n\r\n",
    "header without colon": b"GET /metrics HTTP/1.1\r\nHost\r\n\r\n",
    "nul bytes": b"\x00" * 512,
    "non-utf8 path": b"GET /\xff\xfe\xfd HTTP/1.1\r\n\r\n",
    "path traversal": b"GET /../../../etc/passwd HTTP/1.1\r\n\r\n",
    "absolute uri": b"GET http://evil.example/metrics HTTP/1.1\r\n\r\n",
    "huge request line": b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
    "huge header": b"GET /metrics HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n",
    "many headers": b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(500)) + b"\r\n",
    "lying content-length": b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999\r\n\r\nshort",
    "negative content-length": b"POST /metrics HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    "bad chunked body": b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnope\r\n",
    "header injection": b"GET /metrics?x=%0d%0aSet-Cookie:a HTTP/1.1\r\n\r\n",
    "bad query": b"GET /metrics?name[]=%ff%fe&name[]= HTTP/1.1\r\n\r\n",
    "bad accept": b"GET /metrics HTTP/1.1\r\nAccept: \xff\xfe;;;q=abc\r\nAccept-Encoding: gzip;q=zz\r\n\r\n",
    "tls hello on plain port": bytes.fromhex("16030100a5010000a10303") + bytes(range(256)) * 2,
    "http2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64,
    "unknown method": b"BREW /pot HTTP/1.1\r\n\r\n",
    "http/0.9 request": b"GET /metrics\r\n",
    "lf only": b"GET /metrics HTTP/1.1\nHost: x\n\n",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_request(exporter: ExporterProcess, name: str):
    """Expectation: each malformed request gets an HTTP error or a closed
    connection (never a hang), and the next valid scrape succeeds."""
    reply, _ = exchange(exporter.port, MALFORMED[name])
    assert is_http_reply(reply), reply[:200]
    if name in ("huge request line", "huge header", "many headers"):
        status = reply.split(b" ", 2)[1] if reply else b""
        assert status in (b"414", b"431", b"400"), reply[:200]
    assert_valid_scrape(exporter)


def _fuzz_case(rng: random.Random) -> bytes:
    valid = (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/openmetrics-text\r\n"
             b"Accept-Encoding: gzip\r\n\r\n")
    kind = rng.randrange(4)
    if kind == 0:   # random bytes
        return rng.randbytes(rng.randrange(0, 4096))
    data = bytearray(valid)
    if kind == 1:   # bit flips
        for _ in range(rng.randrange(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif kind == 2:  # random insertions
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(data))
            data[i:i] = rng.randbytes(rng.randrange(1, 200))
    else:            # truncation
        del data[rng.randrange(len(data)):]
    return bytes(data)


def test_seeded_fuzz(exporter: ExporterProcess):
    """Expectation: FUZZ_CASES seeded cases (random bytes, bit flips, random
    insertions, truncations of a valid request), 16 at a time: every
    connection is answered or closed within CLOSE_WITHIN_S, a valid scrape
    succeeds after every 100 cases, and afterwards the exporter's thread count
    is back near its idle level (nothing leaked or stuck)."""
    rng = random.Random(FUZZ_SEED)
    cases = [_fuzz_case(rng) for _ in range(FUZZ_CASES)]
    replies: list[bytes] = []
    with ThreadPoolExecutor(16) as pool:
        for start in range(0, FUZZ_CASES, 100):
            replies += [r for r, _ in pool.map(lambda c: exchange(exporter.port, c), cases[start:start + 100])]
            assert_valid_scrape(exporter)
    assert all(is_http_reply(r) for r in replies), [r[:100] for r in replies if not is_http_reply(r)][:3]
    answered = sum(1 for r in replies if r)
    print(f"fuzz: {FUZZ_CASES} cases (seed {FUZZ_SEED}), {answered} answered with HTTP, the rest closed")
    wait_until(lambda: _threads(exporter.proc.pid) <= 8, timeout=CLOSE_WITHIN_S,
               what="exporter threads back to idle")


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def test_slow_clients(exporter: ExporterProcess):
    """Expectation: 100 slowloris clients (headers trickled one line a second,
    never finished) and 20 clients that connect and send nothing do not stop
    valid scrapes (each answered within 3 s meanwhile), and the server closes
    every one of them by the header deadline (HEADER_DEADLINE_S) plus slack."""
    port = exporter.port
    slow: list[socket.socket] = []
    for i in range(120):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if i < 100:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
        slow.append(s)
    opened = time.monotonic()
    closed_at: dict[int, float] = {}
    stop = threading.Event()

    def trickle():
        n = 0
        while not stop.is_set() and len(closed_at) < len(slow):
            for i, s in enumerate(slow[:100]):
                if i in closed_at:
                    continue
                try:
                    s.sendall(b"X-Slow-%d: x\r\n" % n)
                except OSError:
                    closed_at[i] = time.monotonic() - opened
            n += 1
            stop.wait(1.0)

    def watch_idle():
        for i, s in enumerate(slow[100:], start=100):
            s.settimeout(HEADER_DEADLINE_S + 10)
            try:
                while s.recv(1024):
                    pass
            except OSError:
                pass
            closed_at[i] = time.monotonic() - opened

    threads = [threading.Thread(target=trickle, daemon=True), threading.Thread(target=watch_idle, daemon=True)]
    for t in threads:
        t.start()
    try:
        latencies = []
        while time.monotonic() - opened < HEADER_DEADLINE_S - 2:
            t0 = time.monotonic()
            assert_valid_scrape(exporter)
            latencies.append(time.monotonic() - t0)
            time.sleep(0.2)
        assert max(latencies) < 3.0, latencies
        wait_until(lambda: len(closed_at) == len(slow), timeout=HEADER_DEADLINE_S + 10, what="slow clients closed")
        assert max(closed_at.values()) < HEADER_DEADLINE_S + 8, sorted(closed_at.values())[-5:]
        print(f"slow clients: {len(slow)} closed after {min(closed_at.values()):.1f}-{max(closed_at.values()):.1f} s; "
              f"valid scrapes meanwhile: {len(latencies)}, max {max(latencies) * 1000:.0f} ms")
    finally:
        stop.set()
        for s in slow:
            s.close()
    assert_valid_scrape(exporter)
