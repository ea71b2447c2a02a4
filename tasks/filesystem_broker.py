"""The demo's broker without a server: kombu's filesystem transport, minus one failure.

kombu creates a message's file, then writes it. A consumer that takes the file in
between reads it empty, fails to decode it and stops consuming (kombu issue 1551); a
process killed in between (the demo SIGKILLs a worker) leaves it empty for good, so a
job requeued after the kill waited forever for a wakeup. Here such a file is skipped:
what it held was a wakeup, and the sweeper sends a lost wakeup again.
"""

from __future__ import annotations

import json

from kombu.transport import filesystem


class Channel(filesystem.Channel):
    def _get(self, queue):
        while True:
            try:
                return super()._get(queue)
            except json.JSONDecodeError:  # (the file is off the queue already: the next one)
                continue


class Transport(filesystem.Transport):
    Channel = Channel
