"""HTTP plumbing for SGLang servers: errors, one-request-per-connection JSON calls, version parsing.

Standard library only (``http.client``): the trainer image should not need ``requests`` just for this,
and a fresh connection per request keeps the client trivially thread-safe.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
import urllib.parse
from typing import Any


class SGLangError(RuntimeError):
    """Base class of everything the SGLang engine raises on purpose."""


class SGLangServerError(SGLangError):
    """A server failed to start, died, or stopped answering; the message names its URL and log file."""


class SGLangRequestError(SGLangError):
    """A server answered but rejected a request (HTTP 4xx, or ``success: false``)."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class SGLangResponseError(SGLangError):
    """A server answered 200 with a body that does not follow SGLang's documented shape."""


class SGLangWeightSyncError(SGLangError):
    """A weight update was refused or left the servers with weights other than the trainer's."""


class TransportError(Exception):
    """No usable HTTP answer: connection refused or reset, timeout, or a 5xx. Worth a retry."""

    def __init__(self, message: str, *, kind: str, status: int | None = None):
        super().__init__(message)
        self.kind = kind  # "refused" | "reset" | "timeout" | "http5xx"
        self.status = status


@dataclasses.dataclass
class HttpResponse:
    status: int
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            raise SGLangResponseError(f"expected JSON, got {self.body[:200]!r}") from None

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace").strip()


def split_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``http(s)://host:port``."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"not an http(s) server URL: {url}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return parsed.scheme, parsed.hostname, port


def request(
    base_url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    api_key: str | None,
    timeout: float,
) -> HttpResponse:
    """One HTTP request with a JSON body; raises :class:`TransportError` for anything retryable."""
    scheme, host, port = split_url(base_url)
    conn_cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body, separators=(",", ":")).encode("utf-8")
        headers["Content-Type"] = "application/json"
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = conn_cls(host, port, timeout=timeout)
    where = f"{method} {base_url}{path}"
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
        status = resp.status
    except ConnectionRefusedError as err:
        raise TransportError(f"{where}: connection refused ({err})", kind="refused") from None
    except TimeoutError as err:
        raise TransportError(f"{where}: no answer within {timeout:g}s ({err})", kind="timeout") from None
    except (ConnectionError, http.client.HTTPException, OSError) as err:
        raise TransportError(f"{where}: connection failed ({type(err).__name__}: {err})", kind="reset") from None
    finally:
        conn.close()
    if status >= 500:
        text = payload[:300].decode("utf-8", errors="replace")
        raise TransportError(f"{where}: HTTP {status} {text}", kind="http5xx", status=status)
    return HttpResponse(status, payload)


_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int]:
    """``'0.5.21.post1'`` / ``'0.5.22rc0'`` / ``'0.5.23.dev4+g1a2b'`` -> ``(0, 5, 21)`` etc."""
    match = _VERSION_RE.match(str(text))
    if not match:
        raise SGLangResponseError(f"cannot read an SGLang version from {text!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def error_message(resp: HttpResponse) -> str:
    """The human part of an SGLang error body (``{"message": ..}``, ``{"error": {"message": ..}}`` or text)."""
    try:
        data = json.loads(resp.body)
    except ValueError:
        return resp.text()[:500]
    if isinstance(data, dict):
        if isinstance(data.get("error"), dict) and "message" in data["error"]:
            return str(data["error"]["message"])[:500]
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])[:500]
    return json.dumps(data)[:500]
