"""The ``celery-lease`` command: a launcher for the example pipeline's demo.

The demo application (``tasks/``) is the repository's example, not part of the library,
so the wheel does not ship it; this launcher finds it in a source checkout (the working
directory) and says how to get one otherwise.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from tasks import demo
    except ImportError:
        sys.path.insert(0, os.getcwd())
        try:
            from tasks import demo
        except ImportError:
            print(
                "celery-lease demo runs the example pipeline of a source checkout: run `bash dev.sh demo` from the repository",
                file=sys.stderr,
            )
            return 2
    return demo.main(argv)
