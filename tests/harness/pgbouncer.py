"""A private PgBouncer in transaction mode in front of a PostgreSQL server.

    with private_pgbouncer(pool_size=4) as bouncer:
        url = bouncer.url_for(db_url)      # the same database, through PgBouncer
        bouncer.show("POOLS")              # its admin console: SHOW POOLS, SERVERS, ...

Runs Debian's ``pgbouncer`` (``bash dev.sh test`` installs it) on a free port from a
temporary directory, so it never touches a system-wide instance:

* ``pool_mode = transaction``: a server connection belongs to a client for one
  transaction only, as in the deployments this stands in for; a session feature
  (LISTEN, SQL-level PREPARE, session advisory locks, SET without LOCAL, temporary
  tables) is not carried from one transaction to the next.
* ``default_pool_size``: the server connections per (database, user), kept smaller than
  the clients of a test so clients really queue for servers.
* ``ignore_startup_parameters = options``: celery-lease sends per-connection settings
  (``-c statement_timeout=...``) in the startup packet, which PgBouncer refuses
  otherwise; behind it they are dropped (docs/operations.md, "Running at scale").
* ``auth_type = trust`` with an auth_file naming the current user, who also logs in to
  PostgreSQL (trust over 127.0.0.1, as the tests' shared server is set up).

PgBouncer refuses to run as root: as root it is started with ``-u postgres`` (the OS user
of Debian's PostgreSQL packages) and its directory is owned by that user. It is stopped
by its PID (SIGTERM: immediate shutdown) in ``close()``.
"""

from __future__ import annotations

import getpass
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

from tests.harness.services import free_port, wait_for

#: The OS user PgBouncer runs as when we are root (it refuses root).
OS_USER = "postgres"


def binary() -> str | None:
    """Debian installs it in /usr/sbin, which a non-root PATH often lacks."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")


def available() -> bool:
    return binary() is not None


class PgBouncer:
    def __init__(self, *, server_host: str = "127.0.0.1", server_port: int = 5432, pool_size: int = 4) -> None:
        self.server = (server_host, server_port)
        self.pool_size = pool_size
        self.port = free_port()
        self.user = getpass.getuser()
        self.dir = Path(tempfile.mkdtemp(prefix="celery-lease-pgbouncer-"))
        self.log_path = self.dir / "pgbouncer.log"
        self.proc: subprocess.Popen | None = None

    def url_for(self, url: str) -> str:
        """``url``'s database (and user), reached through PgBouncer."""
        return sa.engine.make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def start(self) -> PgBouncer:
        host, port = self.server
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "\n".join(
                [
                    "[databases]",
                    # Any database name: the throwaway database of the run, whatever it is.
                    f"* = host={host} port={port}",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    f"logfile = {self.log_path}",
                    "pool_mode = transaction",
                    f"default_pool_size = {self.pool_size}",
                    "min_pool_size = 0",
                    "reserve_pool_size = 0",
                    "max_client_conn = 2000",
                    "max_db_connections = 0",
                    "auth_type = trust",
                    f"auth_file = {self.dir / 'users.txt'}",
                    f"admin_users = {self.user}",
                    "ignore_startup_parameters = options",
                    # A server connection that broke (a cut proxy, a terminated backend)
                    # is replaced at once rather than after the default 15 s.
                    "server_login_retry = 1",
                    "",
                ]
            )
        )
        args = [binary() or "pgbouncer", str(self.dir / "pgbouncer.ini")]
        if os.getuid() == 0:
            entry = pwd.getpwnam(OS_USER)
            for path in [self.dir, *self.dir.iterdir()]:
                os.chown(path, entry.pw_uid, entry.pw_gid)
            args[1:1] = ["-u", OS_USER]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: self._answers() or self.proc.poll() is not None, timeout=15, what="pgbouncer to start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"pgbouncer exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
        return self

    def _answers(self) -> bool:
        try:
            self.show("VERSION")
            return True
        except subprocess.CalledProcessError:
            return False

    def show(self, what: str) -> list[dict[str, str]]:
        """``SHOW <what>`` on the admin console, as rows of column -> text."""
        out = subprocess.run(
            [
                "psql",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                self.user,
                "-d",
                "pgbouncer",
                "-AF",
                "\t",
                "-c",
                f"SHOW {what}",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()
        header, *rows = [line for line in out if line and not line.startswith("(")] or [""]
        keys = header.split("\t")
        return [dict(zip(keys, line.split("\t"))) for line in rows]

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except (FileNotFoundError, PermissionError):
            return ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def private_pgbouncer(**options) -> Iterator[PgBouncer]:
    bouncer = PgBouncer(**options)
    try:
        yield bouncer.start()
    finally:
        bouncer.close()
