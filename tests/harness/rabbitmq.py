"""A private RabbitMQ node for tests that restart the broker (the shared one on 5672 is
never touched): its own node name, AMQP and distribution ports, data, logs and Erlang
cookie in a directory of its own, no plugins. Tests get a throwaway vhost each.

Plain helpers with no pytest dependency, like tests/harness/services.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from tests.harness.services import free_port, wait_for

#: The server's own scripts: the /usr/sbin wrappers switch to the rabbitmq user, who
#: cannot write a test's directory nor read its cookie.
BIN = Path("/usr/lib/rabbitmq/bin")
#: A node boots in 5-15 s on a loaded machine.
BOOT_TIMEOUT = 90.0


def available() -> bool:
    return (BIN / "rabbitmq-server").exists() and shutil.which("erl") is not None


class RabbitNode:
    """rabbitmq-server as ``cl-test-<port>@localhost``; stop() is a SIGKILL (a crash),
    start() boots it again on the same data (durable queues and persistent messages
    survive, as on a real restart)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dist_port = free_port()
        self.workdir = workdir
        self.node = f"cl-test-{self.port}@localhost"
        self.proc: subprocess.Popen | None = None
        (workdir / "enabled_plugins").write_text("")
        (workdir / "rabbitmq-env.conf").write_text("")  # not the system's (it names the shared node)
        self.env = {
            **os.environ,
            "HOME": str(workdir),  # the node's Erlang cookie is made here, readable by this user
            "RABBITMQ_CONF_ENV_FILE": str(workdir / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(workdir / "rabbitmq"),  # none: defaults
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(workdir / "advanced.config"),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(workdir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(workdir / "log"),
            "RABBITMQ_PID_FILE": str(workdir / "pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(workdir / "enabled_plugins"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    def url(self, vhost: str = "/") -> str:
        path = "" if vhost == "/" else vhost
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{path}"

    def start(self) -> None:
        log = open(self.workdir / "server.log", "a")
        self.proc = subprocess.Popen(
            [str(BIN / "rabbitmq-server")],
            env=self.env,
            cwd=self.workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(lambda: self.ping() or self.proc.poll() is not None, timeout=BOOT_TIMEOUT, interval=0.2, what="rabbitmq to boot")
        assert self.proc.poll() is None, (self.workdir / "server.log").read_text()[-3000:]

    def ping(self) -> bool:
        """The AMQP port answers the protocol header (the node has booted)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"AMQP\x00\x00\x09\x01")
                s.settimeout(2)
                return s.recv(8)[:1] == b"\x01"  # a connection.start frame
        except OSError:
            return False

    def stop(self) -> None:
        """SIGKILL the node (its shell and the Erlang VM: one session)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
            wait_for(lambda: not self.ping(), timeout=10, what="rabbitmq to stop")

    def restart(self, downtime: float = 0.0) -> None:
        self.stop()
        time.sleep(downtime)
        self.start()

    def ctl(self, *args: str) -> str:
        command = [str(BIN / "rabbitmqctl"), "-n", self.node, *args]
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=True, timeout=60).stdout

    def add_vhost(self) -> str:
        vhost = f"cl-{uuid.uuid4().hex[:10]}"
        self.ctl("add_vhost", vhost)
        self.ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        return vhost

    def delete_vhost(self, vhost: str) -> None:
        if self.proc is not None and self.ping():
            self.ctl("delete_vhost", vhost)


class RabbitBroker:
    """One vhost of a RabbitNode, shaped like tests.harness.services.RedisServer for the
    chaos fleet (``url``, ``restart``): restarting it restarts the whole node."""

    def __init__(self, node: RabbitNode, vhost: str) -> None:
        self.node = node
        self.vhost = vhost

    @property
    def url(self) -> str:
        return self.node.url(self.vhost)

    def restart(self, downtime: float = 0.0) -> None:
        self.node.restart(downtime)

    def ping(self) -> bool:
        return self.node.ping()
