"""Credentials read from files and the environment into request headers: what a sendable one is, and errors that
name where it came from and what is wrong with it, never the credential itself.

A token that cannot go into an HTTP header (a line break inside it, a character outside ASCII, nothing at all)
would otherwise fail deep in ``http.client`` with an error quoting the whole header, token included, and that
text would reach logs, events and dead-letter reasons. Checked here, it is a configuration error instead: at
start (the config refuses it, naming the field) and at each read of a file that may be rewritten while a service
runs (the caller holds its work and alerts).
"""

from __future__ import annotations

from pathlib import Path

EMPTY = "is empty"


class TokenError(ValueError):
    """A credential that cannot be sent; the message names its source and the problem, never its value.
    ``empty``: there is no token at all (a file being rewritten, say), rather than a malformed one."""

    def __init__(self, message: str, empty: bool = False):
        super().__init__(message)
        self.empty = empty


def token_problem(token: str) -> str | None:
    """What makes ``token`` unsendable as ``Authorization: Bearer <token>``, or None. A token is one word of
    printable ASCII (RFC 6750's token68 and every scheme's keys are within it)."""
    if not token:
        return EMPTY
    if "\n" in token or "\r" in token:
        return "holds a line break"
    if any(ord(char) > 0x7E for char in token):
        return "holds a character outside ASCII"
    if any(ord(char) <= 0x20 or ord(char) == 0x7F for char in token):
        return "holds a space or a control character"
    return None


def header_value_problem(value: str) -> str | None:
    """What makes ``value`` unsendable as an HTTP header value (RFC 9110: printable ASCII and spaces), or None."""
    if not value.strip():
        return EMPTY
    if "\n" in value or "\r" in value:
        return "holds a line break"
    if any(ord(char) > 0x7E for char in value):
        return "holds a character outside ASCII"
    if any((ord(char) < 0x20 and char != "\t") or ord(char) == 0x7F for char in value):
        return "holds a control character"
    return None


def read_token_file(path: Path, field: str) -> str:
    """The token in the file at ``path`` (outer whitespace stripped), which ``field`` names; ``TokenError`` naming
    ``field`` and the file when it cannot be read or is not a sendable token."""
    try:
        raw = path.read_bytes()
    except OSError as error:  # strerror, not str(error): nothing but the path and the reason
        raise TokenError(f"{field}: {str(path)!r} cannot be read ({error.strerror or type(error).__name__})") from None
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:  # its message would quote the bytes
        raise TokenError(f"{field}: {str(path)!r} is not UTF-8 text") from None
    problem = token_problem(token)
    if problem is not None:
        raise TokenError(f"{field}: the token in {str(path)!r} {problem}", empty=problem == EMPTY)
    return token
