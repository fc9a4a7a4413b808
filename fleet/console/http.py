"""The console's HTTP plumbing over `fleet.httpd`: requests parsed into path, query, form and
cookies, and responses that always carry the security headers.

Every response is `no-store` and framed by a Content-Security-Policy that allows scripts,
styles and fetches from this origin only (no inline script, no plugin, no framing), so that a
string that slipped past escaping still could not run."""

from __future__ import annotations

import email.parser
import email.policy
import urllib.parse
from dataclasses import dataclass, field
from email.message import EmailMessage

from fleet.console.session import parse_cookies
from fleet.httpd import CLOSE_AFTER

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # (not no-referrer: with it browsers send `Origin: null` on the console's own forms)
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
REASONS = {
    200: "OK", 303: "See Other", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
    404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 413: "Payload Too Large",
    500: "Internal Server Error", 503: "Service Unavailable",
}  # fmt: skip
HTML = "text/html; charset=utf-8"
MAX_FIELDS = 32
"""Form fields a request may carry (every console form has a handful)."""
MAX_UPLOAD_BYTES = 256 << 10
"""What one field of a multipart form may hold (a Smolfile or an org policy is a few KiB; the
whole body is bounded again by `fleet.httpd`)."""


@dataclass(frozen=True)
class Request:
    method: str
    path: list[str]
    """The path's segments, percent-decoded ("/rollouts/r_1" -> ["rollouts", "r_1"])."""
    query: dict[str, str]
    form: dict[str, str]
    cookies: dict[str, str]
    headers: dict[str, str] = field(repr=False)

    @property
    def peer(self) -> str:
        return self.headers.get(":peer", "")


class BadRequest(ValueError):
    """A request the console cannot read: answered 400 with the reason."""


def _first(pairs: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in pairs:
        out.setdefault(k, v)
    return out


def parse(method: str, target: str, headers: dict[str, str], body: bytes) -> Request:
    """A request as the console's pages read it; a form that is not urlencoded UTF-8, or has
    too many fields, is a BadRequest naming what was wrong."""
    split = urllib.parse.urlsplit(target)
    if not split.path.startswith("/"):
        raise BadRequest(f"request target {target[:80]!r} is not a path")
    path = [urllib.parse.unquote(p) for p in split.path.split("/") if p]
    try:
        query = _first(urllib.parse.parse_qsl(split.query, max_num_fields=MAX_FIELDS))
        form: dict[str, str] = {}
        if method == "POST" and body:
            content_type = headers.get("content-type", "")
            kind = content_type.split(";", 1)[0].strip().lower()
            if kind == "multipart/form-data":
                form = multipart(content_type, body)
            elif kind == "application/x-www-form-urlencoded":
                form = _first(urllib.parse.parse_qsl(
                    body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FIELDS,
                    errors="strict",
                ))  # fmt: skip
            else:
                raise BadRequest(
                    "a form must be application/x-www-form-urlencoded or multipart/form-data, "
                    f"not {kind[:60]!r}"
                )
    except UnicodeDecodeError:
        raise BadRequest("the form is not UTF-8") from None
    except ValueError as exc:
        raise BadRequest(f"unreadable query or form: {exc}") from None
    return Request(method, path, query, form, parse_cookies(headers.get("cookie", "")), headers)


def multipart(content_type: str, body: bytes) -> dict[str, str]:
    """A multipart/form-data body (RFC 7578: a form with a file input) as name -> value, each
    part's content read as UTF-8 text, a file's as well as a field's (the console takes only
    text files). Read with the standard library's MIME parser; whatever it had to guess at (no
    boundary, a part without a name, a missing closing boundary) is a BadRequest saying so,
    rather than a form quietly missing a field."""
    if "boundary=" not in content_type.lower():
        raise BadRequest("multipart form: its Content-Type names no boundary")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if message.defects or not message.is_multipart():
        found = ", ".join(type(d).__name__ for d in message.defects) or "no parts"
        raise BadRequest(f"malformed multipart form: {found}")
    parts = list(message.iter_parts()) if isinstance(message, EmailMessage) else []
    if len(parts) > MAX_FIELDS:
        raise BadRequest(f"multipart form: {len(parts)} parts, over the limit of {MAX_FIELDS}")
    form: dict[str, str] = {}
    for number, part in enumerate(parts, 1):
        name = part.get_param("name", header="content-disposition")
        if part.get_content_disposition() != "form-data" or not isinstance(name, str) or not name:
            raise BadRequest(f"multipart form: part {number} is not a named form-data field")
        if part.defects:
            found = ", ".join(type(d).__name__ for d in part.defects)
            raise BadRequest(f"multipart form: field {name[:40]!r} is malformed: {found}")
        data = part.get_payload(decode=True)
        if not isinstance(data, bytes):
            raise BadRequest(f"multipart form: field {name[:40]!r} has no content")
        if len(data) > MAX_UPLOAD_BYTES:
            raise BadRequest(f"multipart form: field {name[:40]!r} is {len(data)} bytes, "
                             f"over the limit of {MAX_UPLOAD_BYTES}")  # fmt: skip
        try:
            form.setdefault(name, data.decode("utf-8"))
        except UnicodeDecodeError:
            raise BadRequest(f"multipart form: field {name[:40]!r} is not UTF-8 text") from None
    return form


def response(
    status: int, body: bytes = b"", content_type: str = HTML,
    headers: dict[str, str] | None = None,
) -> bytes:  # fmt: skip
    """A whole HTTP/1.1 response with the security headers (and `headers` over them). After
    a refusal `fleet.httpd` closes the connection, and says so to the client."""
    merged = {**SECURITY_HEADERS, **(headers or {})}
    if status in CLOSE_AFTER:
        merged["Connection"] = "close"
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
             f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]  # fmt: skip
    lines += [f"{k}: {v}" for k, v in merged.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def redirect(location: str, headers: dict[str, str] | None = None) -> bytes:
    """303 See Other to a path of this console (the browser GETs it)."""
    if not location.startswith("/") or location.startswith("//"):
        location = "/"
    return response(303, b"", headers={"Location": location, **(headers or {})})


def attachment(name: str) -> str:
    """A Content-Disposition for a download named `name` (attacker-controlled): an ASCII
    fallback of safe characters only, and the exact name percent-encoded (RFC 6266), so that
    no quote, semicolon or line break reaches the header."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in name)
    return (
        f'attachment; filename="{safe or "download"}"; '
        f"filename*=UTF-8''{urllib.parse.quote(name, safe='')}"
    )


def same_origin(headers: dict[str, str]) -> bool:
    """Whether a POST came from this console's own pages: its Origin (when the browser sent
    one) names the host it was sent to. A second line behind the CSRF token."""
    origin = headers.get("origin", "")
    if not origin:
        return True
    if origin == "null":
        return False
    return urllib.parse.urlsplit(origin).netloc == headers.get("host", "")
