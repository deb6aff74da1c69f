"""This machine's network as a multi-machine launch needs it: its interfaces and addresses, and which of
them leads to the rendezvous. No torch here (the launcher reads it before anything starts).

A launch over several machines (`nodes=2 node_rank=K rdzv=HOST:PORT`) must advertise an address the
other machines reach, and the workers' gloo and NCCL sockets must bind the interface that carries it:
left to themselves they take the first address of the host name, which on many machines is loopback
(127.0.1.1 in Debian's /etc/hosts) or a management network the other nodes cannot reach. `route_to`
asks the kernel which local address it would use to reach HOST (a UDP `connect`, which sends nothing),
and `interfaces` names the interface holding it: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME are set to
that interface unless the user set them. `launch doctor` prints `interfaces()`.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import ConfigError

EXAMPLE = "nodes=2 node_rank=0 rdzv=10.0.0.1:29400"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(frozen=True)
class Interface:
    name: str
    address: str  # one IPv4 or IPv6 address of it
    up: bool

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_addresses() -> list[tuple[str, str]]:
    """(interface, address) from /proc/net/if_inet6, link-local ones left out (they need a scope)."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if len(fields) < 6:
                continue
            address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
            if not address.is_link_local:
                found.append((fields[5], str(address)))
    return found


def _is_up(name: str) -> bool:
    try:
        return int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & 0x1 == 1  # IFF_UP
    except (OSError, ValueError):
        return True  # (no sysfs: assume so)


def interfaces() -> list[Interface]:
    """This machine's interfaces with an address (IPv4 first), as the kernel lists them."""
    found: list[Interface] = []
    for _, name in socket.if_nameindex():
        v4 = _ipv4_of(name)
        if v4:
            found.append(Interface(name, v4, _is_up(name)))
    found += [Interface(name, address, _is_up(name)) for name, address in _ipv6_addresses()]
    return found


def _resolve(host: str) -> str:
    """HOST as an address (a name is looked up, IPv4 preferred), or a ConfigError naming the rendezvous."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise ConfigError("rdzv", host, f"the host name does not resolve on this machine ({err}); give node 0's "
                          "address", EXAMPLE) from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def route_to(host: str) -> str:
    """The local address this machine uses to reach `host` (its own address, when HOST is one of ours)."""
    address = _resolve(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))  # UDP: picks the route and the source address, sends nothing
        except OSError as err:
            raise ConfigError("rdzv", host, f"this machine has no route to {address} ({err.strerror}); give node "
                              "0's address on a network every node shares (`launch doctor` lists this machine's)",
                              EXAMPLE) from None
        return str(s.getsockname()[0])


def interface_of(address: str) -> Interface | None:
    return next((i for i in interfaces() if i.address == address), None)


def is_local(address: str) -> bool:
    """Whether `address` belongs to this machine (it can be bound here; no IPv6 here: not ours)."""
    return _bindable(address, 0)


def _bindable(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((address, port))
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class NodeNetwork:
    """Where this node meets the others: the rendezvous, this node's address toward it, its interface."""

    rdzv_host: str  # as typed
    rdzv_address: str  # resolved
    rdzv_port: int
    address: str  # this node's address on the route to the rendezvous: what it advertises
    interface: str  # the interface holding `address`: what gloo and NCCL bind
    hosts_rdzv: bool  # the rendezvous address is one of this machine's: it listens there

    def describe(self) -> str:
        role = "listens there" if self.hosts_rdzv else f"reaches it from {self.address}"
        return f"rendezvous {self.rdzv_address}:{self.rdzv_port} (this node {role}, interface {self.interface})"


def node_network(rdzv_host: str, rdzv_port: int, node_rank: int | None) -> NodeNetwork:
    """This node's place on the network of a multi-machine launch, or a ConfigError saying what to change.

    Who listens: node_rank=0 (the address must be this machine's, the port free); a node_rank above 0
    connects; without node_rank, the node holding the address listens if the port is free and
    connects otherwise (another launch of this world, started on this machine first, listens there).
    A loopback address is taken at its word: every node runs on this machine.
    """
    address = _resolve(rdzv_host)
    local_address = is_local(address)
    if node_rank == 0 and not local_address:
        mine = [i for i in interfaces() if not i.loopback and i.up and ":" not in i.address]
        shown = ", ".join(f"{i.address} ({i.name})" for i in mine) or "none but loopback"
        raise ConfigError("rdzv", f"{rdzv_host}:{rdzv_port}", f"node_rank=0 listens for the other nodes, but "
                          f"{address} is not an address of this machine (its addresses: {shown})",
                          f"nodes=2 node_rank=0 rdzv={mine[0].address if mine else '10.0.0.1'}:{rdzv_port}")
    # node 0 listens; without node_rank, whoever holds the address and finds the port free
    hosts = node_rank == 0 or (node_rank is None and local_address and _bindable(address, rdzv_port))
    if node_rank == 0 and not _bindable(address, rdzv_port):
        raise ConfigError("rdzv", f"{rdzv_host}:{rdzv_port}", "node_rank=0 listens there for the other nodes, but "
                          "the port is taken: pick a free port, the same on every node's command line",
                          f"nodes=2 node_rank=0 rdzv={rdzv_host}:{rdzv_port + 1}")
    local = address if local_address else route_to(address)
    held = interface_of(local)
    if held is None and ipaddress.ip_address(local).is_loopback:  # (127.0.1.1 and the like: on lo too)
        held = next((i for i in interfaces() if i.loopback), None)
    if held is None:
        raise ConfigError("rdzv", f"{rdzv_host}:{rdzv_port}", f"the route to {address} leaves from {local}, which "
                          "no interface of this machine holds; set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME "
                          "yourself", EXAMPLE)
    return NodeNetwork(rdzv_host, address, rdzv_port, local, held.name, hosts)
