"""Credentials never appear in a message, repr or log line: the one place that scrubs them.

Two sources of secrets: the userinfo of a URL (``s3://KEY:SECRET@bucket/prefix``), recognised by its shape
wherever it appears in a text, and the credential values of ``storage_options`` (``key``, ``secret``,
``token``, ``password``, ...), which :func:`register_secrets` records when a storage is opened, so that they are
scrubbed from any later text even where a third-party library put them. :func:`redact` is applied to every
``CheckpointError`` message, to every record of the ``ckptstore`` logger (a filter), and by the CLI to every
line it prints.
"""
from __future__ import annotations

import logging
import re
import threading
from typing import Any, Iterable, Mapping, Optional, Tuple

MASK = "***"
# scheme://user:password@ (the password may hold "/", as AWS secrets do) or scheme://user@
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<info>[^\s@/:]*:[^\s@]*|[^\s@/]+)@")
_SECRET_KEY = re.compile(r"(key|secret|token|passw|credential|session|signature|sas|auth|private)", re.I)
_MIN_SECRET = 4                      # shorter values would scrub ordinary text (and are not real secrets)
_secrets: set = set()
_lock = threading.Lock()


def split_userinfo(url: str) -> Tuple[str, Optional[str]]:
    """``"s3://K:S@bucket/p"`` -> ``("s3://bucket/p", "K:S")``; a URL without userinfo -> ``(url, None)``."""
    m = _USERINFO.match(url)
    if not m:
        return url, None
    return m.group("scheme") + url[m.end():], m.group("info")


def register_secrets(storage_options: Optional[Mapping[str, Any]] = None, *values: str) -> None:
    """Remember credential values (from ``storage_options``, recursively, and ``values``) to scrub them."""
    found = [v for v in values if isinstance(v, str)]

    def walk(obj, key_is_secret=False):
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, key_is_secret or bool(_SECRET_KEY.search(str(k))))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, key_is_secret)
        elif key_is_secret and isinstance(obj, str):
            found.append(obj)
    walk(storage_options or {})
    with _lock:
        _secrets.update(v for v in found if len(v) >= _MIN_SECRET)
        for v in list(found):                       # the password half of a userinfo, alone
            if ":" in v:
                _secrets.update(p for p in v.split(":", 1) if len(p) >= _MIN_SECRET)


def redact(text: Any, extra: Iterable[str] = ()) -> str:
    """``text`` as a str with every URL userinfo and every registered (or ``extra``) secret replaced by ***."""
    s = text if isinstance(text, str) else str(text)
    if "@" in s:
        s = _USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", s)
    with _lock:
        secrets = sorted(_secrets.union(v for v in extra if isinstance(v, str) and len(v) >= _MIN_SECRET),
                         key=len, reverse=True)
    for v in secrets:
        if v in s:
            s = s.replace(v, MASK)
    return s


class RedactingFilter(logging.Filter):
    """Scrubs the formatted message of each record (installed on the ``ckptstore`` logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:                           # a bad format string: leave the record to logging itself
            return True
        clean = redact(msg)
        if clean != msg or record.args:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


def install_log_filter() -> None:
    logger = logging.getLogger("ckptstore")
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())
