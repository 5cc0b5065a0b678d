"""Credentials out of text that is stored, logged, traced or printed.

A receiver URL may carry credentials (`https://user:S3cr3t@host/hook`, `?token=...`),
and so may an exception's text that quotes it. Every place where a URL or an error text
flows into `last_error`, `outbox.attempts.error`, span events or CLI output passes it
through `redact_secrets`: the user-info part of any URL becomes `***` and the value of
a query parameter whose name says it is a secret becomes `***`.

The built-in HTTP handler never lets them get that far in the first place (it moves the
user-info into an `Authorization` header, see dispatcher/handlers.py); this is the net
under everything else, a custom handler's exceptions included.
"""

from __future__ import annotations

import re
import traceback

REDACTED = "***"

# scheme://<userinfo>@host: the greedy class stops at the authority's end (/ ? # or
# whitespace) and backtracks to its last `@`, so a password holding `@` goes too.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^\s/?#]*@")
_SECRET_PARAM = re.compile(
    r"(?i)([?&;][a-z0-9_.\-]*(?:token|secret|passw(?:or)?d|pwd|api[_\-]?key|apikey"
    r"|access[_\-]?key|signature|sig|auth|credential)[a-z0-9_.\-]*=)[^&#\s'\"<>]*")


def redact_secrets(text: str) -> str:
    """`text` with URL credentials and secret-looking query values replaced by ***."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)
    return _SECRET_PARAM.sub(rf"\1{REDACTED}", text)


def exception_attributes(exc: BaseException) -> dict[str, str]:
    """The message and stack trace a span's exception event records, redacted: pass as
    `span.record_exception(exc, attributes=exception_attributes(exc))` (they override
    the SDK's own; a chained cause's text is part of the stack trace)."""
    return {
        "exception.message": redact_secrets(str(exc)),
        "exception.stacktrace": redact_secrets("".join(traceback.format_exception(exc))),
    }
