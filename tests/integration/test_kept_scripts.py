"""The wakeup marks' scripts on the connection a process keeps (broker/redis_direct.py,
KeptScripts): the same answers as the client's own call, one connection for all of a
process's calls, and through a flushed script cache, a Redis restart and a busy
connection, every call still answered."""

from __future__ import annotations

import hashlib
import threading

import pytest
import redis

from celery_lease.broker.redis_direct import KeptScripts

COUNT = "return redis.call('INCR', KEYS[1])"


@pytest.fixture
def client(broker):
    client = redis.Redis.from_url(broker)
    yield client
    client.close()  # (its pool's connections, the kept one included)


@pytest.fixture
def kept(client):
    return KeptScripts(client)


def count(kept: KeptScripts) -> int:
    return kept.eval(COUNT, ["n"], [])


def test_a_script_runs_on_one_kept_connection_and_answers_as_the_clients_eval(client, kept):
    assert [count(kept) for _ in range(5)] == [1, 2, 3, 4, 5]
    # One connection for every call, kept out of the pool; sent by its SHA once loaded.
    pool = client.connection_pool
    assert pool._in_use_connections == {kept._conn} and not pool._available_connections
    assert client.script_exists(hashlib.sha1(COUNT.encode()).hexdigest()) == [True]
    assert kept.eval("return false", [], []) is None and client.eval("return false", 0) is None
    assert kept.eval("return ARGV[1]", [], ["x"]) == b"x" == client.eval("return ARGV[1]", 0, "x")


def test_a_flushed_script_cache_sends_the_script_whole_once(client, kept):
    assert count(kept) == 1
    client.script_flush()
    assert count(kept) == 2
    assert count(kept) == 3


def test_after_a_redis_restart_the_next_call_is_answered_on_a_new_connection(redis_server, kept):
    assert count(kept) == 1
    redis_server.restart()
    # The kept connection is dead: the call goes the client's way (a fresh connection),
    # and the next one keeps a new connection.
    assert count(kept) == 1
    assert count(kept) == 2
    assert kept._conn is not None and kept._conn._sock is not None


def test_a_call_while_another_thread_uses_the_connection_goes_the_clients_way(client, kept):
    assert count(kept) == 1
    answers: list = []
    with kept._lock:  # another thread's call is under way on the kept connection
        thread = threading.Thread(target=lambda: answers.append(count(kept)))
        thread.start()
        thread.join(5)
    assert answers == [2]
    assert count(kept) == 3
