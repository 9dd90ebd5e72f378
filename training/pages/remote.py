"""Where an exporter's page is, and the one HTTP GET every reader fetches it (and Prometheus's
API, and the evidence pages) with.

Every failure is a ``FetchError`` whose message is one line naming the URL and what went
wrong: ``rankscope top`` prints it (a person at a terminal during an incident needs the
cause, not a traceback), the sink logs it and counts the record it lost.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request

PAGE_PATH = "/metrics"


class FetchError(Exception):
    """A URL that cannot be read. The message is one line."""


def page_url(text: str, *, port_required: bool = False) -> str:
    """``host:port``, ``http(s)://host:port`` or a full ``.../metrics`` URL, as the page's URL
    (``/metrics`` where no path is given). ``ValueError`` for another scheme, no host, a port
    that is not a number, or no port where ``port_required``."""
    text = text.strip()
    parts = urllib.parse.urlsplit(text if "://" in text else "http://" + text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text}: not an http(s) URL")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{text}: the port is not a number") from None
    if port is None and port_required:
        raise ValueError(f"{text}: no port")
    path = parts.path if parts.path not in ("", "/") else PAGE_PATH
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def get(url: str, timeout: float) -> bytes:
    """The body at ``url``; ``FetchError`` naming the URL (without its query) and the cause."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise FetchError(f"{url}: not an http(s) URL")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        body = e.read(300).decode(errors="replace").strip().splitlines()
        detail = ""
        try:   # Prometheus explains a bad query in its JSON body
            detail = ": " + json.loads("\n".join(body))["error"]
        except Exception:   # noqa: BLE001 - any other body: the status line is enough
            pass
        raise FetchError(f"{origin(url)}: HTTP {e.code} {e.reason}{detail}") from None
    except urllib.error.URLError as e:
        reason = e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else e.reason
        raise FetchError(f"{origin(url)}: cannot connect ({reason})") from None
    except (TimeoutError, socket.timeout):
        raise FetchError(f"{origin(url)}: no answer within {timeout:g} s") from None
    except (http.client.HTTPException, OSError, ValueError) as e:
        raise FetchError(f"{origin(url)}: {type(e).__name__}: {e}") from None


def fetch(url: str, timeout: float) -> str:
    """The page at ``url`` as text (``FetchError`` as ``get``)."""
    return get(url, timeout).decode(errors="replace")


def origin(url: str) -> str:
    """The URL without its query string: errors stay one readable line."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")) or url
