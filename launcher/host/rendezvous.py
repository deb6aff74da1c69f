"""The rendezvous of a single-machine launch: elastic's c10d rendezvous, on a store bound to loopback.

torch.distributed.elastic's c10d backend and the store it shares with the workers (MASTER_ADDR:
MASTER_PORT) are TCPStores, and a TCPStore server listens on every interface (`*:port`), with no
authentication: anyone on the network could write into the rendezvous or the workers' store while a
launch runs. A single-machine launch needs neither to be reachable from elsewhere. This module
registers the rendezvous backend `launch-loopback`: elastic's own DynamicRendezvousHandler and
C10dRendezvousBackend (nothing re-implemented), over one TCPStore that listens on a socket this module
binds to 127.0.0.1 (TCPStore's `master_listen_fd`); the workers get that same store (elastic's
"agent store") as MASTER_ADDR=127.0.0.1:MASTER_PORT, so no second server is started.

The workers' own sockets: gloo binds the address of GLOO_SOCKET_IFNAME, NCCL's bootstrap the one of
NCCL_SOCKET_IFNAME; plan.py sets both to `lo` for a local launch unless the user set them.
"""

from __future__ import annotations

import socket
from datetime import timedelta

BACKEND = "launch-loopback"
LOOPBACK = "127.0.0.1"


def _loopback_store(timeout_s: float):
    """A TCPStore server that only this machine can reach (bound to 127.0.0.1, port picked by the OS)."""
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=timeout_s),
                     master_listen_fd=listener.detach(), wait_for_workers=False)
    return store


def _create_handler(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = _loopback_store(float(params.get_as_int("read_timeout", 60)))
    class LoopbackBackend(C10dRendezvousBackend):  # elastic's c10d backend, registered under our name
        @property
        def name(self) -> str:
            return BACKEND

    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The store elastic shares with the workers (MASTER_PORT) would be a second server on every
    # interface; hand it this one (multi-tenant; elastic prefixes the workers' keys per attempt).
    handler._create_tcp_store_server = lambda addr, port: store
    return handler


def register() -> None:
    """Make `launch-loopback` known to elastic (once per process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
