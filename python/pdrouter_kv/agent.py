"""A NIXL agent (nixl._api.nixl_agent) whose transfers are kvproxy writes.

It serves what SGLang's nixl backend calls (0.5.18-0.5.23), with NIXL 1.5's
names, arguments and return values. Memory goes to the agent's kvproxy
through a pdrouter_kv TransferEngine (host memory remapped and shared,
device memory by CUDA IPC handle; registered again when kvproxy comes back).
The agent's metadata names it and its kvproxy; a WRITE to a peer agent is
sent to that peer's kvproxy as page writes (control.Client.write_pages),
a prepared transfer's pages all in one request where its descriptors allow.

transfer() sends the requests and returns "PROC" at once. check_xfer_state()
reads whatever replies kvproxy has sent (one recv that does not wait), so the
thread that polls learns of the end itself, with no thread in between. A
notification rides beside kvproxy (pdrouter_kv.notif) once the write is
remotely complete: a thread per peer agent waits for such transfers and
sends it, and a transfer that carries one is DONE only after it was sent.

Host memory registered as "VRAM" is accepted (real NIXL refuses it): SGLang
registers its KV pool so, and on a CPU the pool is host memory.

kvproxy's control socket: $PDROUTER_KVPROXY_SOCK (default /tmp/kvproxy.sock).
"""

import collections
import enum
import itertools
import json
import logging
import os
import socket
import threading
import time

import numpy as np

from . import control, notif, xferplan
from .engine import TransferEngine

logger = logging.getLogger("pdrouter_kv.nixl")

PLUGINS = ("UCX",)
MEM_KINDS = {"DRAM": "DRAM", "VRAM": "VRAM", "cpu": "DRAM", "cuda": "VRAM"}
_MAGIC = "pdrouter-nixl/1"


class nixlError(Exception):
    """Base of the errors NIXL's bindings raise."""


class nixlBackendError(nixlError):
    pass


class nixlCancelledError(nixlError):
    pass


class nixlInvalidParamError(nixlError):
    pass


class nixlNotFoundError(nixlError):
    pass


class nixlNotPostedError(nixlError):
    pass


class nixlNotSupportedError(nixlError):
    pass


class nixlRemoteDisconnectError(nixlError):
    pass


class nixlRepostActiveError(nixlError):
    pass


class RegDList:
    """What register_memory returns: the regions, as nixlRegDList's truth test needs."""

    def __init__(self, kind, regions):
        self.kind, self.regions = kind, regions

    def __len__(self):
        return len(self.regions)


class XferDList:
    """What get_xfer_descs returns: an Nx5 run array and its memory kind."""

    def __init__(self, kind, runs):
        self.kind, self.runs = kind, runs

    def __len__(self):
        return int(self.runs[:, 4].sum()) if len(self.runs) else 0


class _Remote:
    __slots__ = ("name", "kvproxy", "regions", "inbox")

    def __init__(self, md):
        self.name, self.kvproxy, self.inbox = md["name"], md["kvproxy"], md.get("notif")
        self.regions = {k: [(int(a), int(n)) for a, n in v] for k, v in md["regions"].items()}


class _Post:
    """One posting of a transfer: its requests, and how it ended."""

    __slots__ = ("pendings", "state", "notif", "peer", "error", "client", "deadline")

    def __init__(self, notif_msg, peer, deadline):
        # None while transfer() is sending them.
        self.pendings, self.state, self.notif, self.peer = None, "PROC", notif_msg, peer
        self.error = None  # a request that could not be sent
        # Without a notification, whoever polls reads the replies from client
        # and fails the post past deadline; with one, the completer does.
        self.client, self.deadline = None, deadline

    def status(self):
        if self.state != "PROC" or self.pendings is None:
            return self.state
        if all(p.done for p in self.pendings):
            if self.error is not None or any(p.error is not None for p in self.pendings):
                return "ERR"
            if not self.notif:
                return "DONE"
        # With a notification the completer says DONE once that went out too.
        return "PROC"

    def poll(self):
        """status() once the replies kvproxy has sent are read (never waits); ERR past the deadline."""
        client = self.client
        if client is None:
            return self.status()
        state = self.status()
        if state == "PROC":
            _read_ready(client)
            state = self.status()
        if state == "PROC" and time.monotonic() > self.deadline:
            logger.warning("nixl transfer to %s: no reply from kvproxy in time", self.peer.name)
            state = "ERR"
        if state != "PROC":
            self.state, self.client = state, None
        return state


def _read_ready(client):
    """Reads and hands over the replies already in client's socket, without
    waiting; leaves them to the thread reading already, if one is.

    control.Client's reader (Client._read_until) for a caller that polls:
    it follows that reader's framing and its hand-over to waiting callers.
    """
    if not client._read_lock.acquire(blocking=False):
        return
    try:
        buf = client._buf
        while True:
            try:
                chunk = client._sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            if not chunk:
                raise control.ControlClosed("kvproxy closed the control connection")
            buf += chunk
            while len(buf) >= 4:
                n = int.from_bytes(buf[:4], "little")
                if n > control.MAX_FRAME:
                    raise control.ControlClosed("kvproxy sent a %d-byte frame" % n)
                if len(buf) < 4 + n:
                    break
                client._dispatch(buf, 4, 4 + n)
                del buf[:4 + n]
    except (OSError, control.KVProxyError) as e:
        client._fail_all(e if isinstance(e, control.ControlClosed) else control.ControlClosed("control connection: %s" % e))
    finally:
        client._read_lock.release()
        client._hand_over()


class _Xfer:
    __slots__ = ("peer", "writes", "notif", "post")

    def __init__(self, peer, writes, notif_msg):
        self.peer, self.writes, self.notif, self.post = peer, writes, notif_msg, None


# A peer's completer thread waits this long for its next post before it ends
# (a thread started per post would cost SGLang's post its start-up).
COMPLETER_IDLE_S = 30.0


class _PeerQueue:
    __slots__ = ("posts", "ready", "thread")

    def __init__(self, lock):
        self.posts = collections.deque()  # (post, client) in posting order
        self.ready = threading.Condition(lock)
        self.thread = None


class _Core:
    """The agent's state, apart from the agent object so that handles and its
    thread keep it (not the agent) alive."""

    def __init__(self, name, timeout):
        self.name = name
        self.timeout = timeout
        self.lock = threading.RLock()
        self.engine = None
        self.local = {"DRAM": [], "VRAM": []}  # kind -> [(addr, len)] registered
        self.remotes = {}
        self.dlists = {}  # id -> xferplan.DList
        self.xfers = {}  # id -> _Xfer
        self.ids = itertools.count(1)
        # Posts in flight, one queue and completer thread per peer agent: a
        # peer that hangs holds up its own transfers only.
        self.wake = threading.Lock()
        self.inflight = {}  # peer name -> _PeerQueue
        # Posts without a notification whose handle was dropped before they
        # ended: nobody polls them, so in_flight() does.
        self.orphans = collections.deque()
        self.closed = False
        self.inbox = None
        self.outbox = notif.Outbox(name)

    def enqueue(self, post, client):
        """Hands a post to its peer's completer, started if that peer has none."""
        peer = post.peer.name
        with self.wake:
            if self.closed:
                post.state = "ERR"
                return
            q = self.inflight.get(peer)
            if q is None:
                q = self.inflight[peer] = _PeerQueue(self.wake)
                q.thread = threading.Thread(target=self._complete, args=(peer, q), name="nixl-completer", daemon=True)
                q.thread.start()
            q.posts.append((post, client))
            q.ready.notify()

    def _complete(self, peer, q):
        """Reads the replies of one peer's posts (in posting order), then sends
        their notifications; ends after COMPLETER_IDLE_S with none."""
        while True:
            with self.wake:
                if not q.posts and not self.closed:
                    q.ready.wait(COMPLETER_IDLE_S)
                if not q.posts:
                    del self.inflight[peer]
                    return
                post, client = q.posts[0]
            deadline = time.monotonic() + self.timeout
            err = post.error
            for p in post.pendings:
                try:
                    client.wait(p, max(0.0, deadline - time.monotonic()))
                except (OSError, control.KVProxyError) as e:  # TimeoutError is an OSError
                    err = err or e
            if err is None and post.notif:
                try:
                    self.outbox.send(post.peer.inbox, post.notif)
                except (OSError, ValueError, TypeError) as e:
                    err = e
            if err is not None:
                logger.warning("nixl transfer to %s failed: %s", post.peer.name, err)
            post.state = "ERR" if err is not None else "DONE"
            with self.wake:
                q.posts.popleft()

    def in_flight(self):
        with self.lock:
            for _ in range(len(self.orphans)):
                post = self.orphans.popleft()
                if post.poll() == "PROC":
                    self.orphans.append(post)
            orphans = len(self.orphans)
        with self.wake:
            return orphans + sum(len(q.posts) for q in self.inflight.values())

    def close(self):
        with self.wake:
            self.closed = True
            completers = [q.thread for q in self.inflight.values()]
            for q in self.inflight.values():
                q.ready.notify()
        if self.engine is not None:
            self.engine.close()  # fails what is in flight, so the completers end
        if self.inbox is not None:
            self.inbox.close()
        self.outbox.close()
        for t in completers:
            if t is not threading.current_thread():
                t.join(5)


class _Handle:
    """An id in one of the agent's tables, dropped from it by release() or
    when the handle is garbage collected (as NIXL's handles are)."""

    __slots__ = ("_handle", "_core", "_released")
    _table = None

    def __init__(self, core, value):
        self._handle, self._core, self._released = value, core, False

    def __repr__(self):
        return "%s(0x%x, released=%s)" % (type(self).__name__, self._handle, self._released)

    def release(self):
        if not self._released:
            self._released = True
            with self._core.lock:
                getattr(self._core, self._table).pop(self._handle, None)

    def __del__(self):
        self.release()


class nixl_prepped_dlist_handle(_Handle):
    """A prepared descriptor list."""

    __slots__ = ()
    _table = "dlists"


class nixl_xfer_handle(_Handle):
    """A transfer request. Released while posted, its writes still complete
    (kvproxy writes cannot be cancelled)."""

    __slots__ = ()
    _table = "xfers"

    def release(self):
        if not self._released:
            self._released = True
            core = self._core
            with core.lock:
                x = core.xfers.pop(self._handle, None)
                post = x.post if x is not None else None
                # status(), not poll(): this may run in the collector, in a
                # thread holding the control client's locks.
                if post is not None and post.client is not None and post.status() == "PROC":
                    core.orphans.append(post)


def _kind(mem_type):
    kind = MEM_KINDS.get(mem_type)
    if kind is None:
        raise nixlNotSupportedError("memory type %r: kvproxy moves DRAM and VRAM" % (mem_type,))
    return kind


def _bytes(msg):
    if isinstance(msg, str):
        return msg.encode()
    if not isinstance(msg, (bytes, bytearray, memoryview)):
        raise nixlInvalidParamError("notif_msg: want bytes, got %s" % type(msg).__name__)
    return bytes(msg)


def _tensor_descs(descs):
    """(addr, len, dev) rows of a tensor or list of tensors, else None."""
    ts = descs if isinstance(descs, (list, tuple)) and descs and hasattr(descs[0], "data_ptr") else [descs]
    if not all(hasattr(t, "data_ptr") and hasattr(t, "element_size") for t in ts):
        return None, None
    rows = [(t.data_ptr(), t.numel() * t.element_size(), max(t.get_device(), 0)) for t in ts]
    return rows, ("VRAM" if ts[0].get_device() >= 0 else "DRAM")


class nixl_agent:
    """nixl._api.nixl_agent over kvproxy. Thread-safe whatever sync_mode says."""

    def __init__(self, agent_name, nixl_conf=None, instantiate_all=False):
        if not isinstance(agent_name, str) or not agent_name:
            raise nixlInvalidParamError("agent_name: want a non-empty str")
        conf = nixl_conf or nixl_agent_config()
        self.name = agent_name
        self._core = _Core(agent_name, float(os.environ.get("PDROUTER_KVPROXY_TIMEOUT", "30")))
        self.notifs = {}
        self.backends = {}
        self.backend_mems = {}
        self.backend_options = {}
        self.plugin_list = list(PLUGINS)
        for b in (self.plugin_list if instantiate_all else conf.backends):
            init = {"num_threads": str(conf.num_threads)} if conf.num_threads > 0 else {}
            self.create_backend(b, init)

    def __del__(self):
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()

    # Backends.

    def get_plugin_list(self):
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend):
        return ["DRAM", "VRAM"] if backend in self.plugin_list else []

    def get_plugin_params(self, backend):
        return {}

    def get_backend_mem_types(self, backend):
        return self.backend_mems.get(backend, [])

    def get_backend_params(self, backend):
        return self.backend_options.get(backend, {})

    def create_backend(self, backend, initParams={}):
        """Connects to kvproxy (once for the agent: every backend name is kvproxy)."""
        if backend not in self.plugin_list:
            raise nixlNotFoundError("backend %r: this NIXL (kvproxy) offers %s" % (backend, self.plugin_list))
        if not isinstance(initParams, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in initParams.items()):
            raise nixlInvalidParamError("initParams: want dict[str, str]")
        core = self._core
        with core.lock:
            if core.engine is None:
                engine = TransferEngine()
                if engine.initialize("", "", "", "") != 0:
                    raise nixlBackendError("cannot reach kvproxy at %s" % os.environ.get("PDROUTER_KVPROXY_SOCK", control.DEFAULT_SOCK))
                core.engine = engine
        self.backends[backend] = len(self.backends) + 1
        self.backend_mems[backend] = ["DRAM", "VRAM"]
        self.backend_options[backend] = dict(initParams)

    def _engine(self):
        if self._core.engine is None:
            raise nixlBackendError("no backend: call create_backend first")
        return self._core.engine

    # Memory.

    def get_reg_descs(self, descs, mem_type=None):
        if isinstance(descs, RegDList):
            return descs
        rows, tkind = _tensor_descs(descs)
        if rows is not None:
            return RegDList(tkind, [(a, n, d, "") for a, n, d in rows])
        if isinstance(descs, np.ndarray):
            if descs.ndim != 2 or descs.shape[1] != 3:
                raise nixlInvalidParamError("an Nx3 array is needed for registration")
            descs = [(int(a), int(n), int(d), "") for a, n, d in descs.tolist()]
        if mem_type is None:
            raise nixlInvalidParamError("mem_type is needed for a list of regions")
        kind = _kind(mem_type)
        try:
            regions = [(int(a), int(n), int(d), str(m)) for a, n, d, m in descs]
        except (TypeError, ValueError) as e:
            raise nixlInvalidParamError("want (addr, len, dev, meta) tuples: %s" % e) from None
        if any(a < 0 or n <= 0 for a, n, _, _ in regions):
            raise nixlInvalidParamError("a region with a negative address or no length")
        return RegDList(kind, regions)

    def register_memory(self, reg_list, mem_type=None, backends=[]):
        descs = self.get_reg_descs(reg_list, mem_type)
        engine = self._engine()
        addrs = [a for a, _, _, _ in descs.regions]
        lens = [n for _, n, _, _ in descs.regions]
        with self._core.lock:
            if engine.batch_register_memory(addrs, lens) != 0:
                raise nixlBackendError("kvproxy refused the registration of %d regions (see the log)" % len(addrs))
            self._core.local[descs.kind] += list(zip(addrs, lens))
        return descs

    def deregister_memory(self, dereg_list, backends=[]):
        if not isinstance(dereg_list, RegDList):
            raise nixlInvalidParamError("deregister_memory takes what register_memory returned")
        engine = self._engine()
        addrs = [a for a, _, _, _ in dereg_list.regions]
        with self._core.lock:
            ret = engine.batch_unregister_memory(addrs)
            mine = self._core.local[dereg_list.kind]
            for a, n, _, _ in dereg_list.regions:
                if (a, n) in mine:
                    mine.remove((a, n))
        if ret != 0:
            raise nixlNotFoundError("some of %d regions were not registered" % len(addrs))

    def get_xfer_descs(self, descs, mem_type=None):
        if isinstance(descs, XferDList):
            return descs
        rows, tkind = _tensor_descs(descs)
        if rows is not None:
            return XferDList(tkind, xferplan.runs(rows))
        if isinstance(descs, np.ndarray) and (descs.ndim != 2 or descs.shape[1] != 3):
            raise nixlInvalidParamError("Nx3 shape required for a transfer descriptor list")
        if mem_type is None:
            raise nixlInvalidParamError("mem_type is needed for a list of descriptors")
        try:
            return XferDList(_kind(mem_type), xferplan.runs(descs))
        except xferplan.DescError as e:
            raise nixlInvalidParamError(str(e)) from None

    # Metadata.

    def get_agent_metadata(self):
        """Names this agent, its kvproxy, its regions and its notification inbox."""
        core = self._core
        engine = self._engine()
        with core.lock:
            if core.inbox is None:
                core.inbox = notif.Inbox(engine.peer_address().rsplit(":", 1)[0])
            md = dict(magic=_MAGIC, name=self.name, kvproxy=engine.peer_address(), notif=core.inbox.address,
                      regions={k: v for k, v in core.local.items()})
        return json.dumps(md).encode()

    def add_remote_agent(self, metadata):
        try:
            md = json.loads(bytes(metadata))
            if md.get("magic") != _MAGIC:
                raise ValueError("not a pdrouter nixl agent's metadata")
            remote = _Remote(md)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise nixlInvalidParamError("agent metadata: %s" % e) from None
        with self._core.lock:
            self._core.remotes[remote.name] = remote
        return remote.name

    def remove_remote_agent(self, agent):
        with self._core.lock:
            remote = self._core.remotes.pop(agent, None)
        if remote is None:
            raise nixlNotFoundError("remote agent %r is not loaded" % (agent,))
        if remote.inbox:
            self._core.outbox.forget(remote.inbox)

    def check_remote_metadata(self, agent, descs=None):
        with self._core.lock:
            remote = self._core.remotes.get(agent)
        if remote is None:
            return False
        if descs is None or not len(descs):
            return True
        d = self.get_xfer_descs(descs)
        return xferplan.inside(d.runs, remote.regions.get(d.kind, []))

    def make_connection(self, remote_agent, backends=[]):
        remote = self._remote(remote_agent)
        client = self._engine().control()
        if client is None:
            raise nixlBackendError("kvproxy is not reachable")
        try:
            client.probe(remote.kvproxy)
        except (OSError, control.KVProxyError) as e:
            raise nixlRemoteDisconnectError("%s: %s" % (remote_agent, e)) from None

    def _remote(self, name):
        with self._core.lock:
            remote = self._core.remotes.get(name)
        if remote is None:
            raise nixlNotFoundError("remote agent %r is not loaded" % (name,))
        return remote

    # Transfers.

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=[]):
        """Prepares a list for make_prepped_xfer: local ("" or "NIXL_INIT_AGENT") or a loaded remote agent's."""
        strided = isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5
        if strided:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            try:
                d = XferDList(_kind(mem_type), xferplan.runs(xfer_list))
            except xferplan.DescError as e:
                raise nixlInvalidParamError(str(e)) from None
        else:
            d = self.get_xfer_descs(xfer_list, mem_type)
        local = agent_name in ("", "NIXL_INIT_AGENT", self.name)
        if local:
            regions = self._core.local[d.kind]
            owner = ""
        else:
            regions = self._remote(agent_name).regions.get(d.kind, [])
            owner = agent_name
        if len(d) > 0x7FFFFFFF:
            raise nixlInvalidParamError("more descriptors than int32 indices reach")
        with self._core.lock:
            if not xferplan.inside(d.runs, regions):
                raise nixlNotFoundError("descriptors outside the %s memory %s registered" % (d.kind, "this agent" if local else agent_name))
            h = next(self._core.ids)
            self._core.dlists[h] = xferplan.DList(d.runs, d.kind, owner)
        return nixl_prepped_dlist_handle(self._core, h)

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                          notif_msg=b"", backends=[], skip_desc_merge=False):
        self._op(operation)
        with self._core.lock:
            src = self._core.dlists.get(getattr(local_xfer_side, "_handle", None))
            dst = self._core.dlists.get(getattr(remote_xfer_side, "_handle", None))
        if src is None or dst is None:
            raise nixlInvalidParamError("a descriptor list handle that is not this agent's or was released")
        if src.agent != "":
            raise nixlInvalidParamError("the local side was prepared for agent %r" % src.agent)
        if dst.agent == "":
            raise nixlNotSupportedError("loopback transfers: kvproxy writes to peers only")
        try:
            writes = xferplan.plan(src, xferplan.indices(local_indices, "local_indices"),
                                   dst, xferplan.indices(remote_indices, "remote_indices"))
        except xferplan.DescError as e:
            raise nixlInvalidParamError(str(e)) from None
        return self._new_xfer(self._remote(dst.agent), writes, notif_msg)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"", backends=[]):
        self._op(operation)
        remote = self._remote(remote_agent)
        src, dst = self.get_xfer_descs(local_descs), self.get_xfer_descs(remote_descs)
        if len(src) != len(dst):
            raise nixlInvalidParamError("%d local and %d remote descriptors" % (len(src), len(dst)))
        if not xferplan.inside(src.runs, self._core.local[src.kind]):
            raise nixlNotFoundError("local descriptors outside the %s memory this agent registered" % src.kind)
        if not xferplan.inside(dst.runs, remote.regions.get(dst.kind, [])):
            raise nixlNotFoundError("remote descriptors outside the %s memory %s registered" % (dst.kind, remote_agent))
        s, d = xferplan.DList(src.runs, src.kind, ""), xferplan.DList(dst.runs, dst.kind, remote_agent)
        every = np.arange(len(src), dtype=np.int64)
        try:
            writes = xferplan.plan(s, every, d, every)
        except xferplan.DescError as e:
            raise nixlInvalidParamError(str(e)) from None
        return self._new_xfer(remote, writes, notif_msg)

    @staticmethod
    def _op(operation):
        if operation != "WRITE":
            raise nixlNotSupportedError("operation %r: kvproxy serves WRITE" % (operation,))

    def _new_xfer(self, remote, writes, notif_msg):
        x = _Xfer(remote, writes, _bytes(notif_msg))
        with self._core.lock:
            h = next(self._core.ids)
            self._core.xfers[h] = x
        return nixl_xfer_handle(self._core, h)

    def _xfer(self, handle):
        with self._core.lock:
            x = self._core.xfers.get(getattr(handle, "_handle", None))
        if x is None:
            raise nixlInvalidParamError("a transfer handle that is not this agent's or was released")
        return x

    def transfer(self, handle, notif_msg=b""):
        """Posts the transfer: "PROC" once its requests are sent to kvproxy, "ERR" if they cannot be."""
        x = self._xfer(handle)
        core = self._core
        msg = _bytes(notif_msg) or x.notif
        if msg and not x.peer.inbox:
            raise nixlInvalidParamError("remote agent %r takes no notifications" % x.peer.name)
        with core.lock:
            if x.post is not None and x.post.poll() == "PROC":
                raise nixlRepostActiveError("the transfer is still in flight")
            post = x.post = _Post(msg, x.peer, time.monotonic() + core.timeout)
        client = self._engine().control()
        if client is None:
            post.state = "ERR"
            return "ERR"
        sent = []
        try:
            for op, body in xferplan.frames(client, x.peer.kvproxy, x.writes):
                sent.append(client.post(op, body))
        except (OSError, ValueError, control.KVProxyError) as e:
            logger.warning("nixl transfer to %s: %s", x.peer.name, e)
            if not sent:
                post.state = "ERR"
                return "ERR"
            # Some went out: they are settled, and the post is an ERR.
            post.error = e
        if msg:
            post.pendings = sent
            core.enqueue(post, client)
        else:
            post.client = client
            post.pendings = sent
        return "PROC"

    def check_xfer_state(self, handle):
        """"DONE", "PROC" or "ERR"; never waits."""
        post = self._xfer(handle).post
        if post is None:
            raise nixlNotPostedError("the transfer was never posted")
        return post.poll()

    def release_xfer_handle(self, handle):
        handle.release()

    def release_dlist_handle(self, handle):
        handle.release()

    def query_xfer_backend(self, handle):
        self._xfer(handle)
        return self.plugin_list[0]

    # Notifications.

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        remote = self._remote(remote_agent_name)
        if not remote.inbox:
            raise nixlInvalidParamError("remote agent %r takes no notifications" % remote_agent_name)
        try:
            self._core.outbox.send(remote.inbox, _bytes(notif_msg))
        except OSError as e:
            raise nixlRemoteDisconnectError("notification to %s: %s" % (remote_agent_name, e)) from None

    def get_new_notifs(self, backends=[]):
        inbox = self._core.inbox
        return inbox.take() if inbox is not None else {}

    def update_notifs(self, backends=[]):
        for name, msgs in self.get_new_notifs().items():
            self.notifs.setdefault(name, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name, lookup_tag, backends=[], tag_is_prefix=True):
        msgs = self.update_notifs().get(remote_agent_name, [])
        for m in msgs:
            if (m.startswith(lookup_tag) if tag_is_prefix else lookup_tag in m):
                msgs.remove(m)
                return True
        return False

    # For tests and harnesses: what the agent still holds.

    def held(self):
        """(prepared lists, transfer handles, postings in flight) the agent holds."""
        core = self._core
        with core.lock:
            return len(core.dlists), len(core.xfers), core.in_flight()

    def close(self):
        """Drops the kvproxy connection (and with it every registration). Not NIXL's: its agent ends when dropped."""
        self._core.close()


class nixl_agent_config:
    def __init__(self, enable_prog_thread=True, enable_listen_thread=False, listen_port=5555,
                 capture_telemetry=False, num_threads=0, backends=["UCX"], sync_mode=None):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError("sync_mode must be a nixl_thread_sync_t (got %r)" % type(sync_mode).__name__)
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


class nixl_thread_sync_t(enum.Enum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3
