"""Who may reach a tigon server. A server that only this machine can reach needs no credential;
one that listens on an address other machines can reach is refused without one, unless the user
says explicitly (`--insecure`) that the network in between is trusted."""

from __future__ import annotations

import ipaddress
import socket
import sys


def is_loopback(host: str) -> bool:
    """True when `host` (an IP address, or a name such as ``localhost``) reaches only this machine.
    A name counts as loopback only when every address it resolves to is one; a name that does not
    resolve does not count (it cannot be listened on either)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    # an IPv6 address may carry a zone ("fe80::1%eth0"), which ip_address does not take
    addresses = {info[4][0].split("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_listen_address(command: str, host: str, has_credential: bool, insecure: bool, credential: str) -> None:
    """Refuse, as one ValueError line, to listen on a `host` other machines can reach when no
    credential is set, unless `insecure`: then warn on stderr instead. `credential` says how the
    user sets one, e.g. ``"--api-key KEY (or TIGON_API_KEY)"``."""
    if has_credential or is_loopback(host):
        return
    if not insecure:
        raise ValueError(f"--host {host} can be reached from other machines and no credential is set: set "
                         f"{credential}, or pass --insecure to serve without one")
    print(f"tigon {command}: warning: --insecure: anyone who can reach {host} can use this server without a "
          "credential", file=sys.stderr, flush=True)
