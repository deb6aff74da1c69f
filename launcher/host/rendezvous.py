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

Several machines (`nodes=2 node_rank=K rdzv=HOST:PORT`) use `launch-nodes`: the same handler and c10d
backend, over a TCPStore that node 0 (or the node holding HOST, without node_rank) serves on HOST:PORT
alone (not every interface), and that the other nodes join as clients. The workers' store is served
by the node elastic ranks first: the rendezvous store when that is the rendezvous node, else a store
bound to that node's own advertised address. Elastic orders the nodes by address; when the nodes give
node_rank, the ranks follow it instead (`_NodeRanks`): every node checks that the node ranks given are
0..nodes-1 once each, and they all stop with the same line if not.
"""

from __future__ import annotations

import contextlib
import socket
import time
import weakref
from datetime import timedelta

from launcher.errors import LaunchError

BACKEND = "launch-loopback"
NODES_BACKEND = "launch-nodes"
STORE_READ_TIMEOUT_S = 30  # several machines: the most one operation on the rendezvous store may wait
LOOPBACK = "127.0.0.1"


def _bound_store(address: str, port: int, timeout_s: float):
    """A TCPStore server listening on `address` alone (port 0: picked by the OS)."""
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, port))
    except OSError as err:
        listener.close()
        raise RendezvousError(f"rdzv={address}:{port} cannot be bound on this node ({err.strerror}): pick a free "
                              "port, the same on every node's command line") from None
    listener.listen(1024)
    port = listener.getsockname()[1]
    return TCPStore(address, port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=timeout_s),
                    master_listen_fd=listener.detach(), wait_for_workers=False)


def _loopback_store(timeout_s: float):
    """A TCPStore server that only this machine can reach (bound to 127.0.0.1, port picked by the OS)."""
    return _bound_store(LOOPBACK, 0, timeout_s)


class RendezvousError(LaunchError):
    """The nodes could not meet (unreachable, timed out, node ranks given twice): one line, exit 2."""


_HANDLERS: weakref.WeakSet = weakref.WeakSet()  # the rendezvous handlers this process made (stop_heartbeats)
_SERVED: dict[str, object] = {}  # run_id -> the rendezvous store this node serves to the others, until release()
CLOSED = "launch/closed/"  # + run_id: how many of the other nodes have closed the rendezvous


def stop_heartbeats() -> None:
    """Stop the keep-alive thread of each rendezvous handler this process made, from this thread. Elastic
    leaves it running where the agent ended by a signal (it keeps the rendezvous open for other nodes), and
    the handler, dropped in a reference cycle, was then collected by whichever thread ran the garbage
    collector: on the keep-alive thread itself, its finalizer's join failed and printed a traceback after
    launch's "stopped by SIGINT" line."""
    for handler in list(_HANDLERS):
        handler._stop_heartbeats()


def _create_handler(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = _loopback_store(float(params.get_as_int("read_timeout", 60)))
    class LoopbackBackend(C10dRendezvousBackend):  # elastic's c10d backend, registered under our name
        @property
        def name(self) -> str:
            return BACKEND

    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    _HANDLERS.add(handler)
    # The store elastic shares with the workers (MASTER_PORT) would be a second server on every
    # interface; hand it this one (multi-tenant; elastic prefixes the workers' keys per attempt).
    handler._create_tcp_store_server = lambda addr, port: store
    return handler


def _create_nodes_handler(params):
    """The rendezvous of a launch over several machines (see the module docstring)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host, port = params.endpoint.rsplit(":", 1)
    host = host.strip("[]")
    timeout_s = float(params.get_as_int("join_timeout", 300))
    # One store operation's limit (strategy.timeout_s, within 10-30 s): elastic's rendezvous waits for the
    # other nodes by repeating short ones (up to join_timeout); a node cut off from node 0 gives up on
    # the store this long after its last answer.
    read_s = float(params.get_as_int("read_timeout", STORE_READ_TIMEOUT_S))
    if params.get_as_bool("listen", False):
        store = _bound_store(host, int(port), read_s)
    else:
        # Wait for node 0 quietly: a TCPStore client started first logs a C++ warning per retry.
        started = time.monotonic()
        _wait_for_listener(host, int(port), timeout_s)
        store = _store_client(host, int(port), read_s, max(1.0, timeout_s - (time.monotonic() - started)))

    class NodesBackend(C10dRendezvousBackend):  # elastic's c10d backend, registered under our name
        @property
        def name(self) -> str:
            return NODES_BACKEND

    handler = create_handler(store, NodesBackend(store, params.run_id), params)
    _HANDLERS.add(handler)
    listens = params.get_as_bool("listen", False)
    if listens:
        _SERVED[params.run_id] = store
    local_addr = params.local_addr
    # The workers' store: the rendezvous store where this node serves it, else one on this node's address.
    handler._create_tcp_store_server = lambda addr, port: store if listens else _bound_store(local_addr, 0, read_s)
    node_rank = params.get_as_int("node_rank", -1)
    _NodeRanks(handler, -1 if node_rank is None else node_rank, timeout_s).install()
    # A node that joined adds itself to CLOSED once it has closed the rendezvous: it makes no call on
    # node 0's store after that (the shutdown stopped and joined its keep-alive thread). See release().
    said_closed = None if listens else (lambda: store.add(CLOSED + params.run_id, 1))
    _StoreGuard(handler, read_s, params.endpoint, on_closed=said_closed).install()
    return handler


def release(run_id: str | None, others: int, limit_s: float = 10.0) -> None:
    """Stop serving the rendezvous `run_id` (node 0, after its run ended or every node refused alike): first
    wait, up to `limit_s`, until `others` nodes have closed it. Every node leaves the exit barrier (or reads
    the node ranks given) at once, and the others still ask the store (their keep-alive thread, their
    shutdown); node 0 exiting under them printed torch's C++ warning "recvValueWithTimeout failed ...
    Connection reset by peer" at the end of a run that succeeded, and ended a node still reading the node
    ranks with "launch itself failed: DistNetworkError" instead of the refusal's line.
    `others=0` (this node's run failed or was stopped: the others may be gone) does not wait; `run_id=None`
    releases every rendezvous this process serves."""
    if run_id is None:
        _SERVED.clear()
        return
    store = _SERVED.pop(run_id, None)
    if store is None or others <= 0:
        return
    deadline = time.monotonic() + limit_s
    with contextlib.suppress(Exception):
        while store.add(CLOSED + run_id, 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)


class NodeLost(RuntimeError):
    """The rendezvous stopped answering while the nodes trained: the launch ends (exit 1), bounded."""


class _StoreGuard:
    """Bounds the calls elastic's agent makes on the rendezvous store while the workers run.

    The agent asks the store every monitor interval (`num_nodes_waiting`) and once at the end
    (`shutdown`, then `on_closed` where given). A TCPStore client call on a connection whose far end
    vanished without closing it (a network partition, a machine that lost power) blocks in C++ past the
    store's timeout (seen: over two minutes with a 30 s timeout, until TCP itself gives up after ~15
    min). These calls run on one helper thread instead and give up after `limit_s`:
    `num_nodes_waiting` with NodeLost (the agent then stops this node's workers), `shutdown` quietly.
    Once a call gave up the store is taken for gone: later calls answer at once.
    """

    def __init__(self, handler, limit_s: float, endpoint: str, on_closed=None):
        import queue

        self.handler, self.limit_s, self.endpoint, self.on_closed = handler, limit_s, endpoint, on_closed
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.stuck = False
        self.thread = None  # started at the first call

    def install(self) -> None:
        for name in ("num_nodes_waiting", "shutdown"):
            original = getattr(self.handler, name)
            if name == "shutdown" and self.on_closed is not None:
                original = self._then(original, self.on_closed)
            setattr(self.handler, name, lambda original=original, name=name: self._call(name, original))

    @staticmethod
    def _then(shutdown, on_closed):
        """`shutdown`, then `on_closed()` where it closed the rendezvous (both on the helper thread, bounded)."""
        def shutdown_then() -> bool:
            closed = shutdown()
            if closed:
                with contextlib.suppress(Exception):  # (node 0 gone meanwhile: nothing left to tell)
                    on_closed()
            return closed
        return shutdown_then

    def _serve(self) -> None:
        while True:
            function, box, done = self.calls.get()
            try:
                box.append((True, function()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()

    def _call(self, name: str, function):
        import threading

        if not self.stuck:
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name="launch-rdzv-store", daemon=True)
                self.thread.start()
            box: list = []
            done = threading.Event()
            self.calls.put((function, box, done))
            if done.wait(self.limit_s if name != "shutdown" else min(self.limit_s, 10.0)):
                ok, value = box[0]
                if not ok:
                    raise value
                return value
            self.stuck = True
        if name == "shutdown":
            return False
        raise NodeLost(f"the rendezvous at {self.endpoint} stopped answering for {self.limit_s:.0f} s while the "
                       "nodes trained (node 0 down, or cut off from this node)")


def _store_client(host: str, port: int, read_s: float, limit_s: float):
    """A TCPStore client of the rendezvous at host:port, or a RendezvousError within `limit_s` (what is
    left of rdzv_timeout_s): a program there that accepts connections and never answers holds torch's
    client past its own timeout (over 300 s against rdzv_timeout_s=15), so it is made on a thread
    that is waited for no longer (a daemon, left behind blocked on its socket until launch exits)."""
    import threading

    from torch.distributed import TCPStore

    made: dict[str, object] = {}

    def connect() -> None:
        try:
            made["store"] = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=read_s))
        except BaseException as err:  # noqa: BLE001 - said on the launch's thread
            made["error"] = err

    thread = threading.Thread(target=connect, name="launch-rendezvous-connect", daemon=True)
    thread.start()
    thread.join(limit_s)
    if "store" in made:
        return made["store"]
    err = made.get("error")
    why = (f"it accepted the connection but did not answer within rdzv_timeout_s ({limit_s:.0f} s left)"
           if err is None else str(err).splitlines()[0][:160] if str(err).strip() else type(err).__name__)
    raise RendezvousError(f"the rendezvous at {host}:{port} did not answer as one ({why}): is another program "
                          "listening on that port? Give node 0's rdzv address and port")


def _wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Until something accepts connections at host:port, or a RendezvousError when nothing did in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as err:
            if time.monotonic() + 0.5 >= deadline:
                raise RendezvousError(f"no rendezvous answered at {host}:{port} within rdzv_timeout_s={timeout_s:.0f} "
                                      f"({err.strerror or err}): start node 0's launch (node_rank=0) with the same "
                                      "rdzv, and check that this machine reaches it") from None
        time.sleep(0.5)


class _NodeRanks:
    """Every node's group rank as its node_rank says, once all of them agree that the ranks given are
    0..nodes-1, each once (or that none gave one: elastic's order by address stays)."""

    PREFIX = "launch/node_rank/"

    def __init__(self, handler, node_rank: int, timeout_s: float):
        self.handler, self.node_rank, self.timeout_s = handler, node_rank, timeout_s
        self.elastic_next = handler.next_rendezvous

    def install(self) -> None:
        self.handler.next_rendezvous = self.next_rendezvous

    def next_rendezvous(self):
        from torch.distributed import DistError
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo

        info = self.elastic_next()
        store = info.store  # (elastic's store for this round: keys of earlier rounds do not show)
        keys = [f"{self.PREFIX}{r}" for r in range(info.world_size)]
        try:
            store.set(f"{self.PREFIX}{info.rank}", str(self.node_rank))
            store.wait(keys, timedelta(seconds=self.timeout_s))
            given = [int(v) for v in store.multi_get(keys)]
        except DistError as err:  # (node 0 ended meanwhile: its own line says why)
            why = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise RendezvousError(f"the rendezvous ended while the nodes compared their node_rank ({why}): node 0's "
                                  "output says why; start the same launch on every node again") from None
        if all(g < 0 for g in given):
            return info
        if sorted(given) != list(range(info.world_size)):
            shown = ", ".join("none" if g < 0 else str(g) for g in sorted(given))
            raise RendezvousError(f"the {info.world_size} nodes gave node_rank {shown}: each needs its own, from 0 "
                                  f"to {info.world_size - 1} (or leave node_rank out on every node)")
        return RendezvousInfo(info.store, self.node_rank, info.world_size, info.bootstrap_store_info)


def register() -> None:
    """Make `launch-loopback` and `launch-nodes` known to elastic (once per process)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
    rendezvous_handler_registry.register(NODES_BACKEND, _create_nodes_handler)
    dynamic_rendezvous.get_method_name = _caller_name


def _caller_name(depth: int = 2) -> str:
    """elastic's dynamic_rendezvous.get_method_name, the same name without `inspect.stack()`.

    The handler names each event it records after the method that recorded it, and finds that name with
    `inspect.stack()`, twice, which reads the source lines of every frame on the stack (Hydra's and the
    launcher's included) from disk, even where no event handler is set. A launch records about twenty events
    between its rendezvous and its shutdown; this looks up the same frame's name directly."""
    import sys

    try:
        return sys._getframe(depth).f_code.co_name  # 0: here, 1: the handler's _record, 2: its caller
    except ValueError:  # (a stack shallower than that, as get_method_name answers it)
        return "no_method_name"
