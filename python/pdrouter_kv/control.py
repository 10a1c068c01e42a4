"""Client for kvproxy's control socket (kvtransfer/control/proto.go).

Frame: u32 LE length, then op (u8), request id (u64), body. A reply echoes op
and id, then an error string (empty: ok) and the op's body. Replies may come
out of order. Any number of threads may call at once: whichever caller is
waiting reads the socket for everyone (one at a time) and hands each reply to
its caller, so an uncontended call never waits for a thread switch.
"""

import array
import bisect
import os
import select
import socket
import struct
import sys
import threading
import time

from . import cuda, direct, remap

OP_HELLO = 6
OP_REGISTER_MEMORY = 7
OP_UNREGISTER_MEMORY = 8
OP_WRITE = 9
OP_PROBE = 10
OP_WRITE_PAGES = 11
OP_DIRECT_ROUTE = 13

# Optional ops a kvproxy lists in its Hello reply.
FEATURE_WRITE_PAGES = 1
# It says whether a peer takes this engine's small host writes itself
# (OP_DIRECT_ROUTE; pdrouter_kv.direct).
FEATURE_DIRECT_WRITE = 2

# PDROUTER_KV_DIRECT=0 sends every write through kvproxy.
_DIRECT = os.environ.get("PDROUTER_KV_DIRECT", "1") != "0"
# After a peer could not be reached directly, writes to it go through
# kvproxy for this long (s) before the direct path is tried again.
_DIRECT_RETRY = 1.0

KIND_HOST = 0

# Ops whose effect kvproxy keeps: one that times out may still take effect.
_KEPT_BY_KVPROXY = (OP_REGISTER_MEMORY, OP_UNREGISTER_MEMORY)

DEFAULT_SOCK = "/tmp/kvproxy.sock"
MAX_FRAME = 16 << 20  # kvproxy's limit (kvtransfer/control/proto.go)
MAX_STRING = 4 << 10  # kvproxy's limit on a string in a frame (kvtransfer/wire/codec.go)
# Triples per write frame: 24 bytes each must fit the frame beside the
# longest peer name.
MAX_TRIPLES = (MAX_FRAME - MAX_STRING - 64) // 24
# Ranges one write_pages may name (buffers x pages), kvproxy's MaxPageWrite.
MAX_PAGE_WRITE = 1 << 21
# Bodies this long are sent apart from their head instead of copied behind it.
_SEND_APART = 1 << 16
# Socket send buffer asked for: a big write frame then crosses in fewer
# wake-ups of kvproxy's reader (the kernel caps it at net.core.wmem_max).
_SNDBUF = 4 << 20
# Longest single wait (s): poll() and Event.wait() refuse ~24 days and up; the
# loops around them wait on to the caller's deadline.
_MAX_WAIT = 3600.0

_U32_CODE = next(c for c in "IL" if array.array(c).itemsize == 4)

_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<IBQ")
_TRIPLE = struct.Struct("<QQQ")
_PACK_TRIPLES = 16
_REPLY_HEAD = struct.Struct("<BQI")  # op, request id, error length


class KVProxyError(Exception):
    """kvproxy answered a request with an error."""


class ControlClosed(ConnectionError):
    """The control connection to kvproxy is closed."""


def _string(s):
    b = s.encode()
    if len(b) > MAX_STRING:  # kvproxy would drop the connection, and all it registered
        raise ValueError("string of %d bytes, kvproxy takes at most %d" % (len(b), MAX_STRING))
    return _U32.pack(len(b)) + b


def _interleave(code, *columns):
    """Little-endian bytes of the columns' items interleaved, row by row."""
    k = len(columns)
    out = array.array(code, bytes(array.array(code).itemsize * k * len(columns[0])))
    for j, col in enumerate(columns):
        out[j::k] = array.array(code, col)  # ValueError if a column is short
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def write_frame(peer, srcs, dsts, lens):
    """Client.write()'s request as (op, body), for Client.post()."""
    n = len(srcs)
    if len(dsts) != n or len(lens) != n:
        raise ValueError("write: %d sources, %d destinations, %d lengths" % (n, len(dsts), len(lens)))
    if n > MAX_TRIPLES:
        raise ValueError("write: %d ranges in one call, at most %d" % (n, MAX_TRIPLES))
    try:
        if n <= _PACK_TRIPLES:  # a few: packing beats building arrays
            triples = b"".join(map(_TRIPLE.pack, srcs, dsts, lens))
        else:
            triples = _interleave("Q", srcs, dsts, lens)
    except (OverflowError, TypeError, struct.error) as e:
        raise ValueError("write: addresses and lengths must be unsigned 64-bit ints: %s" % e) from None
    return OP_WRITE, _string(peer) + _U32.pack(n) + triples


class _Reader:
    def __init__(self, body):
        self.b, self.i = body, 0

    def take(self, n):
        if self.i + n > len(self.b):
            raise KVProxyError("malformed reply from kvproxy")
        v = self.b[self.i:self.i + n]
        self.i += n
        return v

    def u8(self):
        return self.take(1)[0]

    def u32(self):
        return _U32.unpack(self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]

    def left(self):
        return len(self.b) - self.i

    def string(self):
        # Go strings need not be UTF-8 (an error can quote a peer's text).
        return self.take(_U32.unpack(self.take(4))[0]).decode(errors="replace")


class _Pending:
    __slots__ = ("done", "wake", "reply", "error", "rid", "op", "waiting")

    def __init__(self):
        self.rid = self.op = 0
        self.done = self.waiting = False
        # Set when done, or when the socket needs a reader; made (under the
        # client's lock) only once someone must wait on it: an uncontended
        # call never does.
        self.wake = None
        self.reply = None
        self.error = None


class _Route:
    """How writes to one peer go: peer is the direct connection (None:
    through kvproxy, until retry_at; None there: for good)."""
    __slots__ = ("peer", "lock", "timeout", "retry_at")

    def __init__(self, peer=None, timeout=0.0, retry_at=None):
        self.peer, self.timeout, self.retry_at = peer, timeout, retry_at
        self.lock = threading.Lock()


def _settled(route):
    """Whether route stands as it is: a direct connection, through kvproxy
    for good, or a failed peer's retry time not yet up."""
    return route is not None and (route.peer is not None or route.retry_at is None
                                  or time.monotonic() < route.retry_at)


class Client:
    """One control connection to the kvproxy at sock_path.

    kvproxy ties what an engine registers to its connection: closing it
    (or the process exiting) unregisters everything.
    """

    def __init__(self, sock_path=None, timeout=30.0):
        self.sock_path = sock_path or os.environ.get("PDROUTER_KVPROXY_SOCK", DEFAULT_SOCK)
        self.timeout = timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(self.sock_path)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
        except OSError as e:
            self._sock.close()
            raise ControlClosed("connect to kvproxy at %s: %s" % (self.sock_path, e)) from e
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending = {}
        self._next_id = 0
        self._closed = None
        self._buf = bytearray()
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self._hup = threading.local()
        self.features = None  # what hello() learnt; None: not asked yet
        # Host memory registered here, mapped at those addresses in this
        # process: what a direct write may read. (sorted starts, start ->
        # end), replaced whole so a writer reads both from one moment.
        self._host = ([], {})
        self._routes = {}  # peer -> _Route
        self._route_lock = threading.Lock()
        # Small writes sent straight to the peer kvproxy, and those that
        # went through kvproxy after all.
        self.direct_writes = self.direct_fallbacks = 0

    def close(self):
        self._fail_all(ControlClosed("control connection closed"))
        with self._route_lock:
            routes, self._routes = self._routes, {}
        for r in routes.values():
            with r.lock:
                if r.peer is not None:
                    r.peer.close()
                    r.peer = None
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._read_lock:  # a reader in poll returns at the shutdown
            self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def alive(self, timeout=0.0):
        """False once this connection is closed or kvproxy has hung up; waits
        up to timeout seconds for a hang-up (without reading: replies stay
        with their callers)."""
        if self._closed is not None:
            return False
        # One poll object per thread (one must not be shared between
        # threads), kept: the engine asks before every call.
        p = getattr(self._hup, "poll", None)
        try:
            if p is None:
                p = select.poll()
                p.register(self._sock, 0)  # HUP, ERR and NVAL are always reported
                self._hup.poll = p
            return not p.poll(int(timeout * 1000))
        except (OSError, ValueError):
            return False

    # Ops.

    def hello(self):
        """Returns (peer_addr, transport): this kvproxy's "host:port" and transport name.

        Also sets self.features, the optional ops it serves (FEATURE_*; 0 from an older kvproxy).
        """
        r = self._call(OP_HELLO, b"")
        peer, transport = r.string(), r.string()
        self.features = r.u32() if r.left() >= 4 else 0
        return peer, transport

    def register_memory(self, addr, length, fd):
        """Registers [addr, addr+length) backed by fd (file offset 0 == addr),
        which must be mapped at addr in this process: small writes from it
        may be read from there (pdrouter_kv.direct)."""
        self._call(OP_REGISTER_MEMORY, struct.pack("<BQQ", KIND_HOST, addr, length), fd=fd)
        with self._lock:
            ends = dict(self._host[1])
            ends[addr] = addr + length
            self._host = (sorted(ends), ends)

    def register_host_memory(self, ptr, length):
        """Remaps [ptr, ptr+length) in place (page-aligned outward) and registers it.

        Returns the registered (start, size).
        """
        start, size = remap.page_span(ptr, length)
        fd = remap.remap(start, size)
        try:
            self.register_memory(start, size, fd)
        finally:
            os.close(fd)
        return start, size

    def register_cuda_memory(self, ptr, length):
        """Registers device memory [ptr, ptr+length) by its allocation's CUDA IPC handle (no remap)."""
        self._call(OP_REGISTER_MEMORY, cuda.register_body(ptr, length))

    def unregister_memory(self, addr):
        with self._lock:  # no direct write reads it from now on
            ends = dict(self._host[1])
            ends.pop(addr, None)
            self._host = (sorted(ends), ends)
        self._call(OP_UNREGISTER_MEMORY, struct.pack("<Q", addr))

    def write(self, peer, srcs, dsts, lens, timeout=None):
        """Writes src[i] -> the peer engine's dst[i] for len[i] bytes; returns once remotely complete.

        A small write of host memory to a peer reached over tcp goes straight
        to the peer's kvproxy (pdrouter_kv.direct); anything else, or any
        doubt there, through this kvproxy.
        """
        r = self._routes.get(peer)
        # A peer found not to be reached over tcp costs one lookup a write.
        if (r is None or r.peer is not None or r.retry_at is not None) and self._direct_fits(srcs, lens) \
                and self._write_direct(peer, r, srcs, dsts, lens, timeout):
            return
        self._call(*write_frame(peer, srcs, dsts, lens), timeout=timeout)

    def _direct_fits(self, srcs, lens):
        """Whether srcs/lens may go direct: few, small, ints, inside host memory registered here."""
        if not _DIRECT or not (self.features or 0) & FEATURE_DIRECT_WRITE or len(srcs) > direct.MAX_RANGES:
            return False
        total = 0
        starts, ends = self._host
        for s, n in zip(srcs, lens):
            if type(s) is not int or type(n) is not int or n <= 0:
                return False
            total += n
            i = bisect.bisect_right(starts, s) - 1
            if total > direct.MAX_BYTES or i < 0 or s + n > ends.get(starts[i], 0):
                return False
        return True

    def _route(self, peer):
        """How writes to peer go now (asks kvproxy the first time, and again
        once a failed peer's retry time is up)."""
        r = self._routes.get(peer)
        if _settled(r):
            return r
        with self._route_lock:
            r = self._routes.get(peer)
            if _settled(r):
                return r
            try:
                reply = self._call(OP_DIRECT_ROUTE, _string(peer))
                ok, timeout_ns = reply.u8(), reply.u64()
                r = _Route(timeout=timeout_ns / 1e9)
                if ok:
                    r.peer = direct.Peer(peer, r.timeout, "engine pid %d" % os.getpid())
            except (KVProxyError, direct.Unavailable, direct.Silent):
                r = _Route(retry_at=time.monotonic() + _DIRECT_RETRY)
            self._routes[peer] = r
            return r

    def _write_direct(self, peer, r, srcs, dsts, lens, timeout):
        """Sends the write straight to peer's kvproxy (r: its route as last
        seen); False: it goes through ours (the peer is reached otherwise, or
        is busy with another thread's write, or could not say how the write
        went)."""
        if r is None or r.peer is None:
            r = self._route(peer)
        if r.peer is None or not r.lock.acquire(blocking=False):
            return False
        try:
            if r.peer is None:  # closed meanwhile
                return False
            limit = min(r.timeout, self.timeout if timeout is None else timeout)
            try:
                r.peer.write(srcs, dsts, lens, time.monotonic() + limit)
            except (direct.Unavailable, direct.Silent) as e:
                if getattr(e, "in_sync", False):
                    self.direct_fallbacks += 1
                    return False
                r.peer.close()
                r.peer, r.retry_at = None, time.monotonic()  # the next write asks kvproxy anew
                if isinstance(e, direct.Unavailable):
                    self.direct_fallbacks += 1
                    return False
                if limit < r.timeout:
                    raise TimeoutError("the peer did not answer a write within %.1fs" % limit) from None
                raise KVProxyError("write to %s: %s within %.1fs" % (peer, e, limit)) from None
            self.direct_writes += 1
            return True
        finally:
            r.lock.release()

    def write_pages(self, peer, buffers, src_pages, dst_pages, timeout=None):
        """Writes the same pages of several buffers: for each (src, dst, page_len) in
        buffers and each i, page src_pages[i] of the buffer (at src + index * page_len)
        into page dst_pages[i] of the peer engine's (at dst + index * page_len).
        Returns once remotely complete.

        The same as write() with a triple per buffer and page, in frames of 24
        bytes a buffer and 8 a page (kvproxy moves GPU pages so without expanding
        them); against a kvproxy that lacks it, it falls back to write().
        """
        for op, body in self.write_pages_frames(peer, buffers, src_pages, dst_pages):
            self._call(op, body, timeout=timeout)

    def write_pages_frames(self, peer, buffers, src_pages, dst_pages):
        """write_pages()'s requests as [(op, body)], for post(): page writes, or
        writes of triples against a kvproxy that lacks them (asks hello() once)."""
        n = len(src_pages)
        if len(dst_pages) != n:
            raise ValueError("write_pages: %d source pages, %d destination pages" % (n, len(dst_pages)))
        if len(buffers) * n > MAX_PAGE_WRITE:
            raise ValueError("write_pages: %d buffers x %d pages, at most %d ranges" % (len(buffers), n, MAX_PAGE_WRITE))
        if any(len(b) != 3 for b in buffers):
            raise ValueError("write_pages: each buffer is (src, dst, page_len)")
        try:
            bufs = _interleave("Q", *zip(*buffers)) if buffers else b""
            pairs = _interleave(_U32_CODE, src_pages, dst_pages)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError("write_pages: buffers must be (src, dst, page_len) unsigned 64-bit ints and pages "
                             "unsigned 32-bit ints: %s" % e) from None
        if self.features is None:
            self.hello()
        if not self.features & FEATURE_WRITE_PAGES:
            srcs, dsts, lens = [], [], []
            for src, dst, page_len in buffers:
                srcs += [src + p * page_len for p in src_pages]
                dsts += [dst + p * page_len for p in dst_pages]
                lens += [page_len] * n
            return [write_frame(peer, srcs[i:i + MAX_TRIPLES], dsts[i:i + MAX_TRIPLES], lens[i:i + MAX_TRIPLES])
                    for i in range(0, len(srcs), MAX_TRIPLES)]
        # kvproxy drops a connection whose frame passes MAX_FRAME (one buffer of
        # MAX_PAGE_WRITE pages does): the pairs go in as many frames as need be.
        head = _string(peer) + _U32.pack(len(buffers)) + bufs
        # Beside the body the frame's length counts op and request id (9, as
        # in _call); each frame adds its pair count.
        per = (MAX_FRAME - 9 - len(head) - _U32.size) // 8
        if per < 1:
            raise ValueError("write_pages: %d buffers do not fit one frame" % len(buffers))
        frames = []
        for i in range(0, max(n, 1), per):
            chunk = pairs[8 * i:8 * (i + per)]
            frames.append((OP_WRITE_PAGES, b"".join((head, _U32.pack(len(chunk) // 8), chunk))))
        return frames

    def probe(self, peer):
        self._call(OP_PROBE, _string(peer))

    # Plumbing.

    def _call(self, op, body, fd=None, timeout=None):
        return self.wait(self.post(op, body, fd), timeout)

    def post(self, op, body, fd=None):
        """Sends one request and returns at once; wait() tells its end.

        Replies are read by whichever caller waits: something must wait for a
        posted request, or its reply stays in the socket. p.done turns true
        when its reply has been read.
        """
        p = _Pending()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            self._next_id += 1
            p.rid, p.op = self._next_id, op
            self._pending[p.rid] = p
        head = _HEAD.pack(len(body) + 9, op, p.rid)
        # A big body (a write of 10^5 ranges) goes as it is, not copied behind its head.
        frame = head + body if len(body) < _SEND_APART or fd is not None else None
        try:
            with self._send_lock:
                if frame is None:
                    self._sock.sendall(head)
                    self._sock.sendall(body)
                elif fd is None:
                    self._sock.sendall(frame)
                else:
                    # The fd rides on the frame's first byte; send the rest plainly.
                    sent = self._sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                    if sent < len(frame):
                        self._sock.sendall(frame[sent:])
        except OSError as e:
            err = ControlClosed("send to kvproxy: %s" % e)
            self._fail_all(err)
            raise err from e
        return p

    def wait(self, p, timeout=None):
        """Waits for a posted request's reply (reading for every caller while it
        waits); returns its body, raises its error, TimeoutError after timeout
        (default self.timeout: the reply is then dropped when it comes)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        p.waiting = True
        while not p.done:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._read_lock.acquire(blocking=False):
                try:
                    self._read_until(p, deadline)
                finally:
                    self._read_lock.release()
                    self._hand_over()
            else:
                with self._lock:
                    if p.wake is None:
                        p.wake = threading.Event()
                    wake = p.wake
                if not p.done:
                    wake.wait(min(left, _MAX_WAIT))
                wake.clear()
        if not p.done:
            with self._lock:
                self._pending.pop(p.rid, None)
            # A reader hands over to the oldest caller, which may be this one:
            # pass the wake on, or the others' replies wait in the socket.
            self._hand_over()
            late = TimeoutError("kvproxy did not answer op %d within %.1fs" % (p.op, limit))
            if p.op in _KEPT_BY_KVPROXY:
                # kvproxy may still carry it out: dropping the connection (and
                # all registered on it) is the one state both sides then agree on.
                err = ControlClosed("%s; closed the connection, so kvproxy drops what this engine registered" % late)
                self._fail_all(err)
                self.close()
                raise err from late
            raise late
        if p.error is not None:
            raise p.error
        return p.reply

    def _hand_over(self):
        """Wakes one waiting caller to read on, now that this one stopped."""
        with self._lock:
            for q in self._pending.values():
                if q.waiting:  # a posted request nobody waits for yet cannot read
                    if q.wake is None:
                        q.wake = threading.Event()
                    q.wake.set()
                    return

    def _read_until(self, p, deadline):
        """Reads and dispatches replies until p's arrives, the deadline passes or the connection ends."""
        try:
            while not p.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                # Asleep in poll(), not in recv(): a unix socket wakes a
                # reader blocked in recv() whenever its send buffer drains
                # (kvproxy taking in our request), and poll() for POLLIN
                # sleeps through that.
                if not self._poll.poll(min(left, _MAX_WAIT) * 1000):
                    continue
                try:
                    chunk = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise ControlClosed("kvproxy closed the control connection")
                buf = self._buf
                buf += chunk
                while len(buf) >= 4:
                    n = _U32.unpack_from(buf)[0]
                    if n > MAX_FRAME:
                        raise ControlClosed("kvproxy sent a %d-byte frame" % n)
                    if len(buf) < 4 + n:
                        break
                    self._dispatch(buf, 4, 4 + n)
                    del buf[:4 + n]
        except (OSError, KVProxyError) as e:
            self._fail_all(e if isinstance(e, ControlClosed) else ControlClosed("control connection: %s" % e))

    def _fail_all(self, err):
        with self._lock:
            if self._closed is None:
                self._closed = err
            pending, self._pending = self._pending, {}
            for p in pending.values():
                p.error = err
                p.done = True
            wakes = [p.wake for p in pending.values() if p.wake is not None]
        for w in wakes:
            w.set()

    def _dispatch(self, buf, start, end):
        """Hands the reply in buf[start:end] to its caller."""
        if end - start < _REPLY_HEAD.size:
            raise KVProxyError("malformed reply from kvproxy")
        _, rid, n = _REPLY_HEAD.unpack_from(buf, start)
        i = start + _REPLY_HEAD.size
        if i + n > end:
            raise KVProxyError("malformed reply from kvproxy")
        # Go strings need not be UTF-8 (an error can quote a peer's text).
        err = buf[i:i + n].decode(errors="replace") if n else ""
        with self._lock:
            p = self._pending.pop(rid, None)
            if p is None:
                return  # its caller gave up waiting
            if err:
                p.error = KVProxyError(err)
            else:
                p.reply = _Reader(bytes(buf[i + n:end]))
            # Done and its wake read under the lock a waiter makes the wake under.
            p.done = True
            wake = p.wake
        if wake is not None:
            wake.set()
