"""The network interface for a rank's gloo/NCCL sockets on a multi-node job: the one routing to MASTER_ADDR."""

from __future__ import annotations

import ipaddress
import socket
from typing import Callable, Mapping, Optional

import psutil

SOCKET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_PROBE_PORT = 9  # any port: a UDP connect() only asks the kernel for a route, it sends nothing


def _source_address(master_addr: str) -> Optional[str]:
    """The local address this host sends from to reach ``master_addr``; None without a route."""
    try:
        infos = socket.getaddrinfo(master_addr, _PROBE_PORT, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def _interface_of(address: str) -> Optional[str]:
    """The name of the interface that holds ``address``."""
    # IPv6 link-local addresses carry their scope ("fe80::1%eth0"), on either side.
    address = address.split("%", 1)[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == address for a in addrs):
            return name
    return None


def route_source(master_addr: str) -> Optional[tuple[str, str]]:
    """(local address, interface name) used to reach ``master_addr``; None when there is no route."""
    address = _source_address(master_addr)
    name = _interface_of(address) if address else None
    return (address, name) if name else None


def route_interface(master_addr: str) -> Optional[str]:
    """The interface this host uses to reach ``master_addr``; None when there is no route."""
    found = route_source(master_addr)
    return found[1] if found else None


def job_nodes(env: Mapping[str, str]) -> int:
    """How many nodes the job's ranks span (Slurm's count, else torchrun's), 1 when unknown."""
    for key in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if env.get(key, "").isdigit():
            return int(env[key])
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        return max(1, int(world) // int(local))
    return 1


def socket_env_hints(env: Mapping[str, str], nnodes: int,
                     route: Callable[[str], Optional[tuple[str, str]]] = route_source) -> dict[str, str]:
    """The ``*_SOCKET_IFNAME`` variables to add to ``env``: none on one node, never one already set."""
    missing = [k for k in SOCKET_VARS if not env.get(k)]
    master = env.get("MASTER_ADDR", "")
    if nnodes <= 1 or not missing or not master:
        return {}
    found = route(master)
    # A loopback route would hide this rank from the others: leave the choice to gloo/NCCL.
    if found is None or ipaddress.ip_address(found[0]).is_loopback:
        return {}
    return {k: found[1] for k in missing}


def describe(env: Mapping[str, str], hints: Mapping[str, str]) -> str:
    """One log line: which interface each socket variable names, and where that came from."""
    master = env.get("MASTER_ADDR", "")
    parts = []
    for key in SOCKET_VARS:
        if key in hints:
            parts.append(f"{key}={hints[key]} (routes to MASTER_ADDR={master})")
        elif env.get(key):
            parts.append(f"{key}={env[key]} (from the environment)")
        else:
            parts.append(f"{key} unset (no non-loopback route to MASTER_ADDR={master or '<unset>'})")
    return "; ".join(parts)
