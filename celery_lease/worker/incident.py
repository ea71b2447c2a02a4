"""What is stored, shown and logged for an exception a handler raised (any exception but a
Failure): an *incident* (docs/guide.md).

The rule: the stored error names the exception's type and a reference, never its text
(``internal error: TimeoutError (ref 3f2a9c1e)``), because a dependency's message may
carry a secret (a DSN, a token, customer data). The same reference is logged with the
full traceback and the job id, for an operator to grep. The prefix ``internal error``
stays, for consumers that match it. With ``lease_error_detail = True`` the text is
included, redacted (:func:`redact`: URL credentials, ``key=value`` secrets, bearer tokens,
JWTs) and capped at DETAIL_CHARS: redaction is a best effort over known shapes, which is
why it is not the default.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from celery_lease.payload import MAX_ERROR_BYTES, cap_error

#: The prefix of every stored error of an exception (not a Failure).
INTERNAL_ERROR = "internal error"
#: With lease_error_detail, at most this many characters of the (redacted) text.
DETAIL_CHARS = 200
#: Only this many characters are redacted, then cut to DETAIL_CHARS: a secret that
#: starts before the cap and ends within the margin is still recognised, and a message
#: of any length costs the same.
REDACT_CHARS = DETAIL_CHARS + 1000
#: What a redacted secret becomes.
REDACTED = "***"

_SECRET_KEYS = (
    r"password|passwd|pwd|pass|secret|token|api[_-]?key|apikey|access[_-]?key|auth|authorization"
    r"|credentials?|session(?:id)?|cookie|private[_-]?key|client[_-]?secret|signature|sig"
)
# Every pattern runs in time linear in the text: a match may start only where a run of
# its characters starts (a lookbehind), so no two attempts rescan the same run, and no
# two unbounded quantifiers over the same characters are adjacent. A backtracking
# pattern here holds the GIL for minutes on a long message, which stops the heartbeat.
_PATTERNS = (
    # scheme://user:password@host (a DSN, a URL with credentials): the userinfo goes. The
    # scan stops at the next "/", so it never runs past the next "://".
    (re.compile(r"(?<=[\w+.-])(://)[^/\s@]*@"), rf"\1{REDACTED}@"),
    # Authorization headers: "Bearer <token>", "Basic <b64>", "Token <t>".
    (re.compile(r"(?i)\b(bearer|basic|token)(\s+)[\w.~+/=-]{4,}"), rf"\1\2{REDACTED}"),
    # password=..., "api_key": "...", secret: ... (libpq DSNs, query strings, dict reprs):
    # a whole word that contains a key (looked for once, from the word's start), then the
    # separator, then the value, which a match consumes.
    (
        re.compile(
            rf"(?i)(?<![\w-])((?=[\w-]*?(?:{_SECRET_KEYS}))[\w-]+['\"]?\s*[=:]\s*)"
            r"(\"[^\"]*\"|'[^']*'|[^\s,;&)}\]]+)"
        ),
        rf"\1{REDACTED}",
    ),
    # JSON Web Tokens, wherever they appear.
    (re.compile(r"(?<![\w-])eyJ[\w-]{4,}\.[\w-]{4,}\.[\w-]*"), REDACTED),
)


def redact(text: str) -> str:
    """``text`` with the secrets of known shapes replaced by REDACTED."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def type_name(exc: BaseException) -> str:
    """The exception's type as an operator searches for it: a builtin by its name
    (``TimeoutError``), any other qualified by its module (``requests.exceptions.ReadTimeout``)."""
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class Incident:
    #: Logged with the traceback; part of ``error``.
    ref: str
    #: The stored (and shown) error.
    error: str


def incident(exc: BaseException, *, detail: bool = False) -> Incident:
    """The incident of ``exc``: a fresh reference, and the error to store."""
    ref = secrets.token_hex(4)
    what = type_name(exc)
    if detail:
        full = str(exc)
        text = redact(full[:REDACT_CHARS])
        if len(text) > DETAIL_CHARS or len(full) > REDACT_CHARS:
            text = text[:DETAIL_CHARS] + "..."
        if text:
            what = f"{what}: {text}"
    # The reference is never cut off by the cap: it is what the operator greps for.
    suffix = f" (ref {ref})"
    return Incident(ref, cap_error(f"{INTERNAL_ERROR}: {what}", MAX_ERROR_BYTES - len(suffix)) + suffix)
