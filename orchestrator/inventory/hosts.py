"""Host names, IP literals, ports and ProxyJump hops, as the inventory accepts them.

Each check returns the value or raises ValueError with one sentence that quotes it, so the
models (and the hostfile reader) refuse the same things in the same words:

- a host or address is an IPv4 dotted quad (four decimal octets 0-255, no leading zeros: some
  tools read `010` as octal 8), an IPv6 literal (bare or in brackets, with an optional
  `%scope`, which a link-local fe80:: address must have), or a DNS name: at most 253 characters, labels of 1 to 63 letters, digits, '-' and
  '_' (ssh_config aliases often hold one) that do not start or end with '-'. A name that
  inet_aton would read as an address (`1.2.3`, `0x7f.1`, `1.2.3.4.5`) is refused as one;
- an address that names no one host is refused: unspecified (`0.0.0.0`, `::`), broadcast
  (`255.255.255.255`) and multicast;
- `canonical_host` spells a host one way (a name in lower case without its trailing dot, an
  IPv4-mapped IPv6 address as IPv4, IPv6 compressed), so two spellings of one host are seen as one;
- a port is written in decimal digits, 1 to 65535, without a sign, a leading zero or '_';
- a ProxyJump is `[user@]host[:port]`, comma-separated, each part checked as above (an IPv6
  hop in brackets: `[fe80::1]:22`).
"""

from __future__ import annotations

import ipaddress
import re

from orchestrator.inventory.fields import USER_RE, excerpt

MAX_HOST = 253
MAX_LABEL = 63

_LABEL_CHARS = re.compile(r"[A-Za-z0-9_-]+", re.ASCII)
_SCOPE = re.compile(r"[A-Za-z0-9]+", re.ASCII)
_DECIMAL_PORT = re.compile(r"[1-9][0-9]{0,4}", re.ASCII)
# A part inet_aton reads as a number: decimal, 0-octal or 0x-hex.
_INET_PART = r"(?:0[xX][0-9A-Fa-f]*|[0-9]+)"
_INET_ATON = re.compile(rf"{_INET_PART}(?:\.{_INET_PART}){{0,3}}\.?", re.ASCII)
_ALL_DIGITS = re.compile(r"[0-9]+(?:\.[0-9]+)*\.?", re.ASCII)

PORT_RULE = "a port is a decimal number from 1 to 65535, written without a sign, leading zeros or '_'"


def port_problem(written: str, value: int | None = None) -> str | None:
    """Why the port written as `written` is refused, or None. `value` is what YAML read it as,
    when it read a number: `0x50` is 80 to YAML, and the message says so."""
    if not _DECIMAL_PORT.fullmatch(written):
        read = "" if value is None or str(value) == written else f" (YAML reads it as {value})"
        return f"{excerpt(written)} is not a port{read}: {PORT_RULE}"
    if not 1 <= int(written) <= 65535:
        return f"{written} is not a port: {PORT_RULE}"
    return None


def check_host(v: str) -> str:
    """`v` if it is a host name or an IP literal; else ValueError saying why not."""
    bad = f"{excerpt(v)} is not a valid host name or address"
    if not v:
        raise ValueError(f"{bad}: it is empty")
    if len(v) > MAX_HOST:
        raise ValueError(f"{bad}: it is {len(v):,} characters long, and a host name or address is at "
                         f"most {MAX_HOST}")
    if "@" in v:
        raise ValueError(f"{bad}: write the user as ssh.user, not in the host")
    if v.startswith("[") or v.endswith("]"):
        inner = v[1:-1] if v.startswith("[") and v.endswith("]") else None
        if inner is None or ":" not in inner:
            raise ValueError(f"{bad}: brackets hold only an IPv6 address, as in [fe80::1]")
        _check_ipv6(inner, bad)
    elif ":" in v:
        _check_ipv6(v, bad, hint=", and a port goes in ssh.port, not after ':'" if v.count(":") == 1 else "")
    elif _ALL_DIGITS.fullmatch(v) or _INET_ATON.fullmatch(v):
        _check_ipv4(v, bad)
    else:
        _check_name(v, bad)
        return v
    _check_one_host(canonical_host(v), bad)
    return v


def canonical_host(v: str) -> str:
    """One spelling per host, for telling whether two inventory entries are the same machine: a
    name in lower case without a trailing dot; an IP literal without brackets, an IPv4-mapped
    IPv6 address as its IPv4 address, IPv6 compressed with its %scope kept. Assumes check_host."""
    v = unbracket(v)
    if ":" in v:
        addr, pct, scope = v.partition("%")
        ip = ipaddress.IPv6Address(addr)
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ip) + (pct + scope if pct else "")
    if _ALL_DIGITS.fullmatch(v):
        return str(ipaddress.IPv4Address(v))
    return v.lower().rstrip(".")


def _check_one_host(canonical: str, bad: str) -> None:
    ip = ipaddress.ip_address(canonical.partition("%")[0])
    if ip.is_unspecified:
        raise ValueError(f"{bad}: {canonical} is the unspecified address (any host); give the node's own address")
    if ip.version == 4 and ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ValueError(f"{bad}: it is the broadcast address; give the node's own address")
    if ip.is_multicast:
        raise ValueError(f"{bad}: it is a multicast address; give the node's own address")


def _check_ipv6(text: str, bad: str, hint: str = "") -> None:
    addr, pct, scope = text.partition("%")
    if pct and not _SCOPE.fullmatch(scope):
        raise ValueError(f"{bad}: the IPv6 scope after '%' must be an interface name of letters and digits")
    try:
        ip = ipaddress.IPv6Address(addr)
    except ValueError as e:
        raise ValueError(f"{bad}: it is not an IPv6 address ({str(e).rstrip('.')}){hint}") from None
    if ip.is_link_local and not pct:
        raise ValueError(f"{bad}: a link-local address (fe80::/10) cannot be reached without its "
                         f"interface; write it after '%', as in [fe80::1%eth0]")


def _check_ipv4(text: str, bad: str) -> None:
    octets = text.rstrip(".").split(".") if text.count(".") == 3 else None
    if octets is None or text.endswith(".") or not all(o.isdigit() for o in octets):
        raise ValueError(f"{bad}: some tools read it as an IPv4 address, but it is not four decimal "
                         f"octets like 10.0.0.1")
    for o in octets:
        if len(o) > 1 and o.startswith("0"):
            plain = ".".join(str(int(x)) for x in octets)
            raise ValueError(f"{bad}: octet {o!r} has a leading zero, which some tools read as octal; "
                             f"write {plain} if that is the address meant")
        if int(o) > 255:
            raise ValueError(f"{bad}: octet {o} is over 255")


def _check_name(text: str, bad: str) -> None:
    name = text[:-1] if text.endswith(".") else text
    for label in name.split("."):
        if not label:
            raise ValueError(f"{bad}: it has an empty label (two dots in a row, or a dot at the start)")
        if len(label) > MAX_LABEL:
            raise ValueError(f"{bad}: label {excerpt(label, 20)} is {len(label)} characters, and a label "
                             f"is at most {MAX_LABEL}")
        if not _LABEL_CHARS.fullmatch(label):
            ch = next(c for c in label if not _LABEL_CHARS.fullmatch(c))
            extra = " (write an internationalized name in its xn-- form)" if not ch.isascii() else ""
            raise ValueError(f"{bad}: it holds {ch!r}; a host name holds only letters, digits, '-', '_' "
                             f"and '.'{extra}")
        if label.startswith("-") or label.endswith("-"):
            raise ValueError(f"{bad}: label {excerpt(label, 20)} starts or ends with '-'")


def split_hop(hop: str) -> tuple[str | None, str, str | None]:
    """One ProxyJump hop `[user@]host[:port]` -> (user or None, host as written, port as written
    or None); an IPv6 host keeps its brackets (`[fe80::1]:22` -> host `[fe80::1]`, port `22`).
    ValueError when something other than ':port' follows ']'. The host is not checked here."""
    user, at, hostport = hop.rpartition("@")
    if hostport.startswith("[") and "]" in hostport:
        inner, _, rest = hostport[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError("after ']' comes ':port' or nothing")
        return (user if at else None), f"[{inner}]", (rest[1:] if rest else None)
    host, colon, port = hostport.partition(":")
    return (user if at else None), host, (port if colon else None)


def unbracket(host: str) -> str:
    """The address a socket takes: `[fe80::1]` -> `fe80::1`; any other host as it is."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def check_proxy_jump(v: str) -> str:
    """`v` if every hop is `[user@]host[:port]` (host checked by check_host, an IPv6 host in
    brackets); else ValueError naming the hop."""
    hops = v.split(",")
    for hop in hops:
        bad = f"{excerpt(v)} is not a valid ProxyJump ([user@]host[:port][,...])"
        if len(hops) > 1:
            bad += f": in hop {excerpt(hop)}"
        try:
            user, host, port = split_hop(hop)
        except ValueError as e:
            raise ValueError(f"{bad}: {e}") from None
        if user is not None and not USER_RE.match(user):
            raise ValueError(f"{bad}: {excerpt(user)} is not a valid user name")
        if not host:
            raise ValueError(f"{bad}: a hop names no host")
        try:
            check_host(host)
        except ValueError as e:
            raise ValueError(f"{bad}: {e}") from None
        if port is not None and (why := port_problem(port)):
            raise ValueError(f"{bad}: {why}")
    return v
