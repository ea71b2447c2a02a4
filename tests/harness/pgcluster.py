"""A throwaway PostgreSQL cluster that a test may crash and restart.

The machine's shared PostgreSQL (127.0.0.1:5432) is used by other tests and by other
people at the same time, so a fault test must never stop it. ``PrivateCluster`` runs
its own ``postgres`` from a temporary directory on a free port instead:

    with private_cluster() as pg:
        url = pg.create_database("jobs")   # postgresql+psycopg2://root@127.0.0.1:PORT/jobs
        ...
        pg.crash()                         # pg_ctl stop -m immediate: no checkpoint
        pg.start()                         # crash recovery replays the WAL

    with replicated_pair() as (primary, standby):   # a synchronous streaming standby
        url = primary.create_database("jobs")       # replicated to the standby
        failover = multi_host_url("jobs", primary, standby)  # libpq's host list, read-write
        primary.crash()
        standby.promote()                           # now the read-write one

The cluster is durable the way production is (``fsync=on``, ``synchronous_commit=on``),
so what a test sees after ``crash()`` is what a real server would keep. Access is
``trust`` over 127.0.0.1 and the unix socket in the temporary directory, and the
bootstrap superuser is named after the current OS user (``root`` on CI), so URLs look
like those of the shared server.

PostgreSQL refuses to run as root: as root, initdb, pg_ctl and postgres run as the
``postgres`` OS user (``runuser``) and the directory is owned by it.

Clean-up is ``close()``: stop the server and remove the directory. The context manager
calls it on the way out, whatever happened in the test, and ``atexit`` calls it for
clusters still open when Python exits. A cluster whose owner died without either (a
SIGKILLed pytest) is removed by the next process that starts a cluster.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Temporary directories are named ``<PREFIX><random>``; the stale-cluster sweep only
#: ever looks at directories with this prefix.
PREFIX = "celery-lease-pg-"
#: PostgreSQL's own name for the OS user it runs as when we are root.
SERVER_OS_USER = "postgres"

_open: set[PrivateCluster] = set()
_open_lock = threading.Lock()
_swept = False


class ClusterError(RuntimeError):
    """A pg_ctl/initdb step failed; the message carries its output and the server log."""


def find_bindir() -> Path:
    """The newest ``/usr/lib/postgresql/<version>/bin`` that has initdb and pg_ctl
    (``$CL_TEST_PG_BINDIR`` overrides)."""
    override = os.environ.get("CL_TEST_PG_BINDIR")
    if override:
        return Path(override)
    candidates = [
        Path(d)
        for d in glob.glob("/usr/lib/postgresql/*/bin")
        if all(os.access(os.path.join(d, tool), os.X_OK) for tool in ("initdb", "pg_ctl"))
    ]
    if not candidates:
        raise ClusterError("no PostgreSQL server binaries in /usr/lib/postgresql/*/bin (bash dev.sh test installs them)")

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", path.parent.name)) or (0,)

    return max(candidates, key=version)


def available() -> bool:
    """Whether a private cluster can be created here (server binaries, and the
    ``postgres`` OS user when running as root)."""
    try:
        find_bindir()
        if os.geteuid() == 0:
            pwd.getpwnam(SERVER_OS_USER)
    except (ClusterError, KeyError):
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (to tell a live owner from a reused PID)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class PrivateCluster:
    """One throwaway PostgreSQL server: its own data directory, port and socket.

    ``PrivateCluster()`` runs initdb at once (about a second); ``start()`` starts the
    server and waits until it accepts connections.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        base_dir: str | os.PathLike | None = None,
        shared_buffers: str = "16MB",
        max_connections: int = 100,
        settings: dict[str, object] | None = None,
        standby_of: PrivateCluster | None = None,
    ) -> None:
        """``standby_of``: instead of an empty cluster, a streaming standby of that
        (running) cluster, copied from it by pg_basebackup (``settings`` are added to
        the copied configuration)."""
        _sweep_stale_clusters()
        self.bindir = find_bindir()
        self.user = pwd.getpwuid(os.getuid()).pw_name  # the role that URLs name
        self.as_root = os.geteuid() == 0
        self.port = port or _free_port()
        self.host = "127.0.0.1"
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base_dir))
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "postgres.log"
        self._closed = False
        with _open_lock:
            _open.add(self)
        try:
            (self.dir / "owner").write_text(f"{os.getpid()} {_proc_start_time(os.getpid())}\n")
            if self.as_root:
                server_user = pwd.getpwnam(SERVER_OS_USER)
                os.chown(self.dir, server_user.pw_uid, server_user.pw_gid)
                # Its parents must let the postgres user through (e.g. a TMPDIR under /root).
                self._run(["test", "-w", str(self.dir)], what=f"access to {self.dir} as {SERVER_OS_USER} (set TMPDIR?)")
            if standby_of is None:
                self._initdb(shared_buffers, max_connections, settings or {})
            else:
                self._basebackup(standby_of, settings or {})
        except BaseException:
            self.close()
            raise

    # --- life cycle ---------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> PrivateCluster:
        """Start the server (after a crash: with crash recovery) and wait until it
        accepts connections."""
        if self._closed:
            raise ClusterError("cluster already closed")
        if self.is_running():
            return self
        self._pg_ctl("start", "-w", "-t", str(int(timeout)), "-l", str(self.log_path), timeout=timeout + 10)
        self._wait_ready(timeout)
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; ``fast`` (the default) ends sessions and checkpoints.
        Nothing happens if it is not running."""
        if self.is_running():
            self._pg_ctl("stop", "-w", "-t", "60", "-m", mode, timeout=70)

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: every backend quits at once, no shutdown
        checkpoint; the next ``start()`` runs crash recovery from the WAL."""
        self.stop(mode="immediate")

    def kill_backend(self, pid: int, timeout: float = 30.0) -> None:
        """SIGKILL one server process (as the OOM killer would) and wait until the server
        takes connections again: the postmaster ends every other backend and replays
        the WAL without restarting (pg_postmaster_start_time() does not change)."""
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        time.sleep(0.2)  # the postmaster reaps the child and starts the reset
        while not self.is_ready():
            if time.monotonic() > deadline:
                raise ClusterError(f"the server did not come back after backend {pid} was killed")
            time.sleep(0.1)

    def restart(self, downtime: float = 0.0, *, crash: bool = False) -> PrivateCluster:
        """Stop (``crash=True``: crash), stay down for ``downtime`` seconds, start."""
        self.crash() if crash else self.stop()
        if downtime > 0:
            time.sleep(downtime)
        return self.start()

    def promote(self, timeout: float = 30.0) -> None:
        """``pg_ctl promote``: a standby ends recovery and accepts writes (on a new
        timeline); waits until it does."""
        self._pg_ctl("promote", "-w", "-t", str(int(timeout)), timeout=timeout + 10)
        self._wait_ready(timeout)

    def in_recovery(self) -> bool:
        """Whether the server is a standby (pg_is_in_recovery())."""
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_is_in_recovery()")
                return bool(cur.fetchone()[0])
        finally:
            conn.close()

    def is_running(self) -> bool:
        if not (self.data_dir / "postmaster.pid").exists():
            return False
        result = self._run([str(self.bindir / "pg_ctl"), "status", "-D", str(self.data_dir)], check=False, what="pg_ctl status")
        return result.returncode == 0

    def is_ready(self) -> bool:
        """Accepting connections on 127.0.0.1 (pg_isready)."""
        result = subprocess.run(
            [
                str(self.bindir / "pg_isready"),
                "-q",
                "-h",
                self.host,
                "-p",
                str(self.port),
                "-U",
                self.user,
                "-d",
                "postgres",
                "-t",
                "2",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self._clean_env(),
        )
        return result.returncode == 0

    def close(self) -> None:
        """Stop the server (immediately: nothing in it is worth a checkpoint) and
        remove the directory. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.data_dir.exists() and (self.data_dir / "postmaster.pid").exists():
                self._pg_ctl("stop", "-w", "-t", "30", "-m", "immediate", timeout=40, check=False)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            with _open_lock:
                _open.discard(self)

    def __enter__(self) -> PrivateCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- databases ----------------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg2://{self.user}@{self.host}:{self.port}/{dbname}"

    def dsn(self, dbname: str = "postgres") -> str:
        """The libpq form of ``url`` (for psycopg2.connect or psql)."""
        return f"host={self.host} port={self.port} user={self.user} dbname={dbname}"

    def connect(self, dbname: str = "postgres", **kwargs):
        """A new psycopg2 connection."""
        import psycopg2

        kwargs.setdefault("connect_timeout", 5)
        return psycopg2.connect(host=self.host, port=self.port, user=self.user, dbname=dbname, **kwargs)

    def create_database(self, name: str) -> str:
        """Create an empty database; return its SQLAlchemy URL."""
        self._admin_sql(f'CREATE DATABASE "{_ident(name)}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self._admin_sql(f'DROP DATABASE IF EXISTS "{_ident(name)}" WITH (FORCE)')

    def set_hba(self, hba: str) -> None:
        """Replace pg_hba.conf (e.g. to make some roles log in with a password) and
        reload the running server."""
        self._run(["sh", "-c", 'cat > "$1"', "sh", str(self.data_dir / "pg_hba.conf")], input=hba, what="write pg_hba.conf")
        self._pg_ctl("reload", timeout=30)

    def log(self) -> str:
        """The server log so far (all starts, including crash recovery)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"data={self.data_dir}"
        return f"<PrivateCluster 127.0.0.1:{self.port} {state}>"

    # --- internals ----------------------------------------------------------------

    def _initdb(self, shared_buffers: str, max_connections: int, settings: dict) -> None:
        # --no-sync: a throwaway cluster need not survive a power cut between initdb and
        # start; crash() kills processes, not the kernel, so the page cache survives it.
        self._run(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                self.user,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            ],
            timeout=120,
            what="initdb",
        )
        conf = {
            "listen_addresses": "127.0.0.1",
            "port": self.port,
            "unix_socket_directories": str(self.dir),
            "fsync": "on",
            "synchronous_commit": "on",
            "full_page_writes": "on",
            "shared_buffers": shared_buffers,
            "max_connections": max_connections,
            "huge_pages": "off",
            "logging_collector": "off",
            "log_line_prefix": "%m [%p] ",
            **settings,
        }
        hba = (
            "# tests/harness/pgcluster.py: trust on the socket and 127.0.0.1 only\n"
            "local all all trust\n"
            "host  all all 127.0.0.1/32 trust\n"
            "local replication all trust\n"
            "host  replication all 127.0.0.1/32 trust\n"
        )
        self._append_conf(conf)
        self._run(["sh", "-c", 'cat > "$1"', "sh", str(self.data_dir / "pg_hba.conf")], input=hba, what="write pg_hba.conf")

    def _basebackup(self, primary: PrivateCluster, settings: dict) -> None:
        # -R: standby.signal and primary_conninfo (streaming from the primary);
        # --checkpoint=fast: do not wait for the primary's next spread checkpoint.
        self._run(
            [
                str(self.bindir / "pg_basebackup"),
                "-D",
                str(self.data_dir),
                "-h",
                primary.host,
                "-p",
                str(primary.port),
                "-U",
                primary.user,
                "-R",
                "--checkpoint=fast",
                "--no-sync",
            ],
            timeout=120,
            what="pg_basebackup",
        )
        # The copied postgresql.conf names the primary's port and socket directory:
        # later lines of the file win.
        self._append_conf({"port": self.port, "unix_socket_directories": str(self.dir), **settings})

    def _append_conf(self, conf: dict) -> None:
        lines = ["", "# tests/harness/pgcluster.py"]
        for key, value in conf.items():
            if isinstance(value, str):
                value = "'" + value.replace("'", "''") + "'"
            lines.append(f"{key} = {value}")
        # Files in the data directory belong to the server user: write them as it.
        self._run(
            ["sh", "-c", 'cat >> "$1"', "sh", str(self.data_dir / "postgresql.conf")],
            input="\n".join(lines) + "\n",
            what="write postgresql.conf",
        )

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if time.monotonic() > deadline:
                raise ClusterError(f"PostgreSQL on port {self.port} not ready after {timeout}s\n" + self.log()[-3000:])
            time.sleep(0.05)

    def _pg_ctl(self, *args: str, timeout: float, check: bool = True):
        return self._run(
            [str(self.bindir / "pg_ctl"), *args, "-D", str(self.data_dir)], timeout=timeout, check=check, what=f"pg_ctl {args[0]}"
        )

    def _admin_sql(self, sql: str) -> None:
        conn = self.connect()
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(sql)
        finally:
            conn.close()

    def _sync_standbys(self) -> int:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'")
                return int(cur.fetchone()[0])
        finally:
            conn.close()

    @staticmethod
    def _clean_env() -> dict:
        # PGDATA, PGPORT, PGHOST... of the caller must not redirect our commands.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.pop("LD_PRELOAD", None)  # e.g. libfaketime: the server keeps the real clock
        env["LC_ALL"] = "C"
        return env

    def _run(self, argv: list[str], *, timeout: float = 60, check: bool = True, input: str | None = None, what: str = ""):
        if self.as_root:
            argv = ["runuser", "-u", SERVER_OS_USER, "--", *argv]
        # Output goes to a file, not a pipe: `pg_ctl start` leaves postgres running, and
        # a pipe it inherited would keep us waiting for EOF.
        with tempfile.TemporaryFile() as out:
            try:
                result = subprocess.run(
                    argv,
                    input=input.encode() if input is not None else None,
                    stdin=None if input is not None else subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self.dir,
                    env=self._clean_env(),
                    timeout=timeout,
                    start_new_session=True,
                )
            except subprocess.TimeoutExpired:
                raise ClusterError(f"{what or argv[0]} timed out after {timeout}s\n" + self.log()[-3000:]) from None
            out.seek(0)
            result.stdout = out.read().decode(errors="replace")
        if check and result.returncode != 0:
            raise ClusterError(
                f"{what or argv[0]} failed (exit {result.returncode}): {shlex.join(argv)}\n"
                f"{result.stdout[-3000:]}\n--- server log ---\n{self.log()[-3000:]}"
            )
        return result


def _ident(name: str) -> str:
    if not name or '"' in name or "\x00" in name:
        raise ValueError(f"bad database name: {name!r}")
    return name


@contextmanager
def private_cluster(**kwargs) -> Iterator[PrivateCluster]:
    """A started ``PrivateCluster``, stopped and removed on the way out (also when the
    body raised). For a pytest fixture::

        @pytest.fixture
        def pg_cluster():
            with private_cluster() as cluster:
                yield cluster
    """
    cluster = PrivateCluster(**kwargs)
    try:
        # Ports are picked free but not reserved: on the rare clash, start on another.
        for attempt in range(3):
            try:
                cluster.start()
                break
            except ClusterError as exc:
                if attempt == 2 or "could not bind" not in str(exc).lower():
                    raise
                cluster.close()
                cluster = PrivateCluster(**kwargs)
        yield cluster
    finally:
        cluster.close()


def multi_host_url(dbname: str, *clusters: PrivateCluster) -> str:
    """One URL naming every cluster, in order, in libpq's multi-host form, that connects
    only to the one accepting writes (``target_session_attrs=read-write``): after a
    failover it finds the promoted standby."""
    first = clusters[0]
    hosts = "&".join(f"host={c.host}:{c.port}" for c in clusters)
    return f"postgresql+psycopg2://{first.user}@/{dbname}?{hosts}&target_session_attrs=read-write"


@contextmanager
def replicated_pair(*, sync_timeout: float = 30.0, **kwargs) -> Iterator[tuple[PrivateCluster, PrivateCluster]]:
    """A started primary and its started streaming standby, the standby synchronous
    (``synchronous_standby_names = '*'``, ``synchronous_commit = on``): a commit the
    primary acknowledged is on the standby, so a promoted standby has it. ``kwargs``
    as for ``private_cluster`` (the standby copies the primary's configuration).

    The standby's own configuration has no synchronous_standby_names (set on the
    primary by ALTER SYSTEM after the copy): once promoted, with no standby of its
    own, its commits do not wait for one."""
    with private_cluster(**kwargs) as primary:
        standby = PrivateCluster(standby_of=primary)
        try:
            standby.start()
            primary._admin_sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
            primary._admin_sql("SELECT pg_reload_conf()")
            deadline = time.monotonic() + sync_timeout
            while not primary._sync_standbys():
                if time.monotonic() > deadline:
                    raise ClusterError("the standby did not become synchronous\n" + standby.log()[-3000:])
                time.sleep(0.05)
            yield primary, standby
        finally:
            standby.close()


@atexit.register
def _close_all() -> None:
    with _open_lock:
        clusters = list(_open)
    for cluster in clusters:
        cluster.close()


def _sweep_stale_clusters() -> None:
    """Remove clusters whose creating process is gone (killed before its clean-up),
    once per process. Clusters of live processes, ours or others', are left alone."""
    global _swept
    if _swept:
        return
    _swept = True
    for path in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        try:
            pid_text, start = (Path(path) / "owner").read_text().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # being created right now, or not ours
        if _proc_start_time(pid) == start:
            continue  # the owner is alive
        data = os.path.join(path, "data")
        if os.path.exists(os.path.join(data, "postmaster.pid")):
            try:
                argv = [str(find_bindir() / "pg_ctl"), "stop", "-w", "-t", "30", "-m", "immediate", "-D", data]
                if os.geteuid() == 0:
                    argv = ["runuser", "-u", SERVER_OS_USER, "--", *argv]
                subprocess.run(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=40, cwd="/"
                )
            except (ClusterError, subprocess.TimeoutExpired, OSError):
                pass
        shutil.rmtree(path, ignore_errors=True)
