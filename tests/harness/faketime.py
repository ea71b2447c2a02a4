"""Run a subprocess with a skewed wall clock (libfaketime), e.g. a `celery beat` whose
host clock is six seconds behind the database's:

    env = skewed_env("-6s", worker_env)
    subprocess.Popen([...], env=env)

Only the wall clock moves (``time.time()``, ``datetime.now()``, CLOCK_REALTIME);
``time.monotonic()`` and ``time.sleep()`` are real (``FAKETIME_DONT_FAKE_MONOTONIC=1``),
as on a host whose NTP is off. The offset is fixed at the child's start and inherited
by its children (a prefork pool), since they inherit the environment. File times read
with stat() are not shifted (Debian builds libfaketime without FAKE_STAT): under "-1h"
a file the child has just written looks an hour into its future.

Offsets: ``"-6s"``, ``"+1h"``, ``"-30"`` (seconds), ``"+1.5m"``, ``"+2d"``, or a number
of seconds (``-6``, ``3600.0``).

Needs the Debian package ``faketime`` (libfaketime) and a C compiler, which
``bash dev.sh test`` installs; tests that need them may ``pytest.skip`` unless
``available()``.

libfaketime 0.9.10 (Debian 12) has a bug that matters here: with
FAKETIME_DONT_FAKE_MONOTONIC=1 it still rewrites the absolute CLOCK_MONOTONIC deadline
that clock_nanosleep(TIMER_ABSTIME) is given, as if it were faked wall-clock time, and
the kernel rejects the result. Python >= 3.11 sleeps exactly that way, so every
``time.sleep()`` fails with ``OSError: [Errno 22] Invalid argument`` (libfaketime issue
#426, fixed in 0.9.11). A ten-line shim, compiled here on first use and preloaded in
front of libfaketime, hands clock_nanosleep on any clock but the wall clock straight to
the kernel; on a fixed libfaketime it changes nothing.

One more 0.9.10 quirk, harmless: it also mistimes waits on monotonic condition
variables (they time out at once), which only makes the GIL switch threads more often:
CPU-bound multithreaded Python runs slower under the skew, never wrongly.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "y": 365 * 86400}
_OFFSET = re.compile(r"^\s*([+-])\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdy]?)\s*$")


@lru_cache(maxsize=1)
def library_path() -> str | None:
    """The path of libfaketime.so.1, or None when it is not installed
    (``$CL_TEST_LIBFAKETIME`` overrides)."""
    override = os.environ.get("CL_TEST_LIBFAKETIME")
    if override:
        return override if os.path.exists(override) else None
    candidates = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        *sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")),
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ]
    for path in candidates:
        if os.path.exists(path):
            return path
    try:
        listed = subprocess.run(["dpkg", "-L", "libfaketime"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    for path in listed:
        if path.endswith("/libfaketime.so.1") and os.path.exists(path):
            return path
    return None


_SHIM_SOURCE = r"""
/* tests/harness/faketime.py: clock_nanosleep on a clock that libfaketime must not fake
   (FAKETIME_DONT_FAKE_MONOTONIC=1) goes straight to the kernel; libfaketime 0.9.10
   would rewrite an absolute CLOCK_MONOTONIC deadline into an invalid one (#426). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int clock_nanosleep(clockid_t clock_id, int flags, const struct timespec *req,
                    struct timespec *rem)
{
  static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);
  if (clock_id != CLOCK_REALTIME && clock_id != CLOCK_REALTIME_COARSE)
    return syscall(SYS_clock_nanosleep, clock_id, flags, req, rem) == 0 ? 0 : errno;
  if (next == NULL)
    next = (int (*)(clockid_t, int, const struct timespec *, struct timespec *))
        dlsym(RTLD_NEXT, "clock_nanosleep");
  return next(clock_id, flags, req, rem);
}
"""


@lru_cache(maxsize=1)
def shim_path() -> str | None:
    """The compiled clock_nanosleep shim (see the module docstring), built once per
    machine into ~/.cache/celery-lease; None when no C compiler is at hand."""
    digest = hashlib.sha256(_SHIM_SOURCE.encode()).hexdigest()[:12]
    name = f"faketime-monotonic-sleep-{digest}.so"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "celery-lease"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.mkdtemp(prefix="celery-lease-faketime-"))
    target = cache / name
    if target.exists():
        return str(target)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    with tempfile.TemporaryDirectory(dir=cache) as build:
        source = Path(build) / "shim.c"
        source.write_text(_SHIM_SOURCE)
        output = Path(build) / name
        result = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(output), str(source), "-ldl"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            return None
        os.replace(output, target)  # atomic: a concurrent builder wins or loses whole
    return str(target)


def available() -> bool:
    """Whether skewed_env() can work here: libfaketime is installed and the shim
    builds."""
    return library_path() is not None and shim_path() is not None


def offset_seconds(offset: str | int | float) -> float:
    """``"-6s"`` -> -6.0, ``"+1h"`` -> 3600.0, ``"-30"`` -> -30.0, ``90`` -> 90.0."""
    if isinstance(offset, (int, float)):
        return float(offset)
    match = _OFFSET.match(offset)
    if not match:
        raise ValueError(f"bad clock offset {offset!r}: want e.g. '-6s', '+1h', '-30', '+2d'")
    sign, number, unit = match.groups()
    seconds = float(number) * _UNITS[unit]
    return -seconds if sign == "-" else seconds


def _faketime_value(seconds: float) -> str:
    # Always whole or decimal seconds with a sign: libfaketime reads fractions with the
    # locale's decimal separator, and "-0" must still start with a sign.
    sign = "-" if seconds < 0 else "+"
    magnitude = abs(seconds)
    text = str(int(magnitude)) if magnitude == int(magnitude) else f"{magnitude:.6f}".rstrip("0")
    return sign + text


def skewed_env(offset: str | int | float, base_env: dict | None = None) -> dict:
    """A copy of ``base_env`` (default: os.environ) that makes a child process see its
    wall clock shifted by ``offset``; monotonic clocks are left alone.

    Raises RuntimeError when libfaketime or the C compiler for the shim is missing
    (see ``available()``).
    """
    lib, shim = library_path(), shim_path()
    if lib is None:
        raise RuntimeError("libfaketime is not installed (apt-get install faketime; bash dev.sh test does it)")
    if shim is None:
        raise RuntimeError(
            "no C compiler to build the clock_nanosleep shim (apt-get install gcc libc6-dev; bash dev.sh test does it)"
        )
    env = dict(os.environ if base_env is None else base_env)
    preload = [p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p and p not in (lib, shim)]
    env.update(
        {
            # The shim first, so that its clock_nanosleep is the one the program calls.
            "LD_PRELOAD": ":".join([shim, lib, *preload]),
            "FAKETIME": _faketime_value(offset_seconds(offset)),
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1",
        }
    )
    # A start-at/rate spec from elsewhere would override the relative offset.
    for key in ("FAKETIME_TIMESTAMP_FILE", "FAKETIME_FMT", "FAKETIME_START_AFTER_SECONDS", "FAKETIME_STOP_AFTER_SECONDS"):
        env.pop(key, None)
    return env


def without_skew(env: dict) -> dict:
    """A copy of ``env`` with libfaketime removed again (for a child that should see
    the real clock although its parent was skewed)."""
    ours = {library_path(), shim_path()}
    env = {k: v for k, v in env.items() if not k.startswith("FAKETIME")}
    preload = [p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p and p not in ours and "libfaketime" not in p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    return env
