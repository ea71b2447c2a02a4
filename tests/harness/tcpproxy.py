"""A TCP proxy between a process and PostgreSQL that a test can freeze or cut.

    proxy = TcpProxy("127.0.0.1", 5432).start()
    url = proxy.url_for(db_url)           # the same database, through the proxy
    proxy.pause()                         # connections stay open, nothing gets through:
                                          # a server that silently stopped answering
    proxy.resume()                        # what was held is delivered
    proxy.cut_reply_to(b"some bytes")     # the next request that contains them reaches
                                          # the server, its reply never reaches the
                                          # client, and the connection drops: a lost reply
    proxy.cut_all()                       # every open connection drops now (new ones
                                          # are accepted): a brief network outage
    proxy.close()

Threads only, no dependencies; one pair of pump threads per connection.
tests/harness/pgfaults.py builds on it: faults aimed at one SQL statement.
"""

from __future__ import annotations

import socket
import threading
import time

import sqlalchemy as sa


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._open = threading.Event()  # set: forwarding; clear: paused
        self._open.set()
        self._closed = False
        self._lock = threading.Lock()
        self._cut_marker: bytes | None = None
        #: Requests whose replies were dropped (cut_reply_to).
        self.cuts = 0
        self._sockets: set[socket.socket] = set()
        #: Until this monotonic time, new connections are closed as soon as accepted.
        self._refuse_until = 0.0

    def url_for(self, url: str) -> str:
        return sa.engine.make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def start(self) -> TcpProxy:
        threading.Thread(target=self._accept, name="tcpproxy-accept", daemon=True).start()
        return self

    def refuse(self, seconds: float) -> None:
        """For ``seconds``, close each new connection as soon as it is accepted, as a
        server that is down or still recovering refuses clients; open ones go on."""
        self._refuse_until = time.monotonic() + seconds

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def cut_reply_to(self, marker: bytes) -> None:
        with self._lock:
            self._cut_marker = marker

    def cut_all(self) -> int:
        """Drop every open connection (both directions, at once); return how many
        sockets were closed. The listener keeps accepting: clients reconnect."""
        sockets = list(self._sockets)
        for s in sockets:
            _drop(s)
        return len(sockets)

    def close(self) -> None:
        self._closed = True
        self._open.set()
        for s in [self._listener, *list(self._sockets)]:
            _drop(s)

    # --- internals ------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if time.monotonic() < self._refuse_until:
                _drop(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            # As PostgreSQL and libpq do: a proxy that forwards a reply in several sends
            # (pgfaults.py sends each protocol message alone) must not let Nagle hold
            # the later ones until the peer's delayed ACK, 40 ms per round trip.
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets.update((client, upstream))
            self._serve(client, upstream)

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        """Start forwarding one accepted connection (a subclass may parse it)."""
        pair = {"cut": False}
        threading.Thread(target=self._pump, args=(client, upstream, pair, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, pair, False), daemon=True).start()

    def _seen(self, pair: dict, data: bytes) -> None:
        """What a client sent on one connection (``pair`` is that connection's state),
        before it is forwarded: a subclass may parse it."""

    def _pump(self, source: socket.socket, sink: socket.socket, pair: dict, from_client: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                self._open.wait()
                if self._closed:
                    break
                if from_client:
                    self._seen(pair, data)
                    with self._lock:
                        marker = self._cut_marker
                        if marker is not None and marker in data:
                            self._cut_marker = None
                            pair["cut"] = True
                elif pair["cut"]:
                    # The server has answered the marked request: drop the answer and
                    # the connection, as a network failure right after the commit would.
                    self.cuts += 1
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                _drop(s)
                self._sockets.discard(s)


def _drop(s: socket.socket) -> None:
    """Shut a socket down both ways (the peer sees the connection end) and close it."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
