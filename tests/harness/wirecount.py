"""Round trips to PostgreSQL, counted on the wire.

psycopg2 speaks the simple query protocol: every round trip its client makes (a
statement, an EXECUTE of a prepared one, a BEGIN or a COMMIT) is one ``Q`` message. A
:class:`CountingProxy` parses what clients send through it and counts those, so a test
can say how many round trips a job costs without instrumenting the code it measures.
(The extended protocol's ``S``ync ends its round trips: counted too.)

The URL through it must not negotiate TLS (``sslmode=disable``): the count needs the
plain stream.
"""

from __future__ import annotations

import struct
import threading

import sqlalchemy as sa

from tests.harness.tcpproxy import TcpProxy

#: The untyped messages a connection may start with: SSLRequest, GSSENCRequest, then the
#: StartupMessage (protocol 3.0); every later message starts with its type byte.
_NEGOTIATION = {80877103, 80877104}
_ROUND_TRIP_ENDS = {ord("Q"), ord("S")}


class CountingProxy(TcpProxy):
    def __init__(self, host: str = "127.0.0.1", port: int = 5432) -> None:
        super().__init__(host, port)
        self._count_lock = threading.Lock()
        self._round_trips = 0

    def url_for(self, url: str) -> str:
        return (
            sa.engine.make_url(super().url_for(url))
            .update_query_dict({"sslmode": "disable"})
            .render_as_string(hide_password=False)
        )

    @property
    def round_trips(self) -> int:
        with self._count_lock:
            return self._round_trips

    def _seen(self, pair: dict, data: bytes) -> None:
        buf = pair.setdefault("buf", bytearray())
        buf += data
        typed = pair.get("typed", False)
        counted = 0
        while True:
            if not typed:
                if len(buf) < 8:
                    break
                (length, code) = struct.unpack("!II", buf[:8])
                if len(buf) < length:
                    break
                del buf[:length]
                typed = code not in _NEGOTIATION  # the StartupMessage: typed from here on
                continue
            if len(buf) < 5:
                break
            kind = buf[0]
            (length,) = struct.unpack("!I", buf[1:5])
            if len(buf) < 1 + length:
                break
            del buf[: 1 + length]
            counted += kind in _ROUND_TRIP_ENDS
        pair["typed"] = typed
        if counted:
            with self._count_lock:
                self._round_trips += counted
