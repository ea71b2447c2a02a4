"""The demo's filesystem broker (tasks/filesystem_broker.py) goes past an empty message
file, which kombu's own transport cannot decode (kombu issue 1551): a worker SIGKILLed
between creating a message's file and writing it leaves one, and the demo kills one."""

from __future__ import annotations

import json

import pytest
from kombu import Connection


def _queue_with_a_torn_message(tmp_path, transport):
    folder = tmp_path / "queue"
    folder.mkdir()
    options = {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(tmp_path / "control"),  # (kombu's default is ./control)
        "polling_interval": 0.01,
    }
    conn = Connection("filesystem://", transport=transport, transport_options=options)
    queue = conn.SimpleQueue("q")
    (folder / "0_torn.q.msg").touch()  # the oldest file: taken first
    queue.put({"n": 1})
    return conn, queue


def test_an_empty_message_file_is_skipped(tmp_path):
    conn, queue = _queue_with_a_torn_message(tmp_path, "tasks.filesystem_broker:Transport")
    try:
        assert queue.get(timeout=1).payload == {"n": 1}
    finally:
        queue.close()
        conn.release()


def test_kombus_own_transport_stops_at_it(tmp_path):
    conn, queue = _queue_with_a_torn_message(tmp_path, None)
    try:
        with pytest.raises(json.JSONDecodeError):
            queue.get(timeout=1)
    finally:
        queue.close()
        conn.release()
