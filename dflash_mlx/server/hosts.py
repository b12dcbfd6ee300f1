"""The Host check: a web page in the user's browser can reach a server on
127.0.0.1 by a name of its own (DNS rebinding), and that name is what the
browser sends as Host. So every request must name this server: its bound
address, a loopback name, or a host allowed with --allowed-host."""

from __future__ import annotations

import ipaddress

from starlette.datastructures import Headers

from .errors import APIError, error_response

LOOPBACK = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


def host_name(header: str) -> str:
    """The name in a Host header, without its port: 'a.b:80' -> 'a.b', '[::1]:80' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[1:end] if end > 0 else ""
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class AllowedHosts:
    """The names a request's Host may give. A server bound to every address
    (0.0.0.0) also answers to any IP address: a rebinding page always sends
    a name, never an address. "*" turns the check off."""

    def __init__(self, bound: str = "127.0.0.1", extra: tuple[str, ...] = ()):
        self.everything = "*" in extra
        self.names = {host_name(h) for h in (*LOOPBACK, bound, *extra) if h != "*"}
        self.any_ip = bound in WILDCARDS

    def allows(self, header: str | None) -> bool:
        if self.everything:
            return True
        if not header:
            return False
        name = host_name(header)
        return name in self.names or (self.any_ip and _is_ip(name))


class HostCheck:
    """ASGI middleware answering a request whose Host is not allowed with a 400."""

    def __init__(self, app, allowed: AllowedHosts):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host")
            if not self.allowed.allows(host):
                name = host_name(host or "") or "HOST"
                error = APIError(
                    400,
                    f"the Host header {host!r} does not name this server; start it with "
                    f"--allowed-host {name} to answer to that name.",
                    param="Host",
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
