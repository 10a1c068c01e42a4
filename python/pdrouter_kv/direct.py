"""Small host writes sent by the engine itself, straight to the peer kvproxy.

Over tcp a write through kvproxy crosses four processes (engine -> its
kvproxy -> the peer kvproxy -> back twice), and each wake-up costs tens of
microseconds on a busy host. A small write of host memory can skip the
engine's own kvproxy: the engine connects to the peer kvproxy's peer port as
a write-only client (kvtransfer/directwrite.go) and sends the bytes as DATA
frames and a fence, which the peer answers once they are in its engine's
memory, as it does for a peer kvproxy. The engine's kvproxy still says
whether the peer is reached over tcp (control.Client.write asks it once per
peer).

Frames (kvtransfer/wire): "KV", version, type, u32 LE payload length, payload.
"""

import bisect
import ctypes
import socket
import struct
import time

VERSION = 2
T_DATA = 3
T_MEM_REGIONS_REQ = 8
T_MEM_REGIONS = 9
T_MEM_FENCE = 10
T_MEM_FENCE_ACK = 11
T_MEM_CLIENT = 16
KIND_HOST = 0

# What goes direct: at most this many bytes in at most this many ranges.
# python/harness/direct_bound.py on 2 loaded cores: 64 KiB direct took
# 0.53x the time through kvproxy, 256 KiB 1.7x (the engine's copy and
# join), so the bound is kvproxy's own start-now one (kvtransfer/immediate.go).
MAX_BYTES = 64 << 10
MAX_RANGES = 64

_HEAD = struct.Struct("<2sBBI")
_DATA = struct.Struct("<2sBBIIQ")  # header, region, offset
_SEQ = struct.Struct("<2sBBIQ")  # header, seq: MEM_FENCE, MEM_REGIONS_REQ
_ACK_OK = struct.Struct("<2sBBIQI")  # header, seq, error length (0)
_REGION = struct.Struct("<IBQQQI")  # id, kind, base, len, addr, rkey length
_MAX_PAYLOAD = 4 << 20  # wire.MaxControlLen
# Longest single blocking receive (s): a wait is sliced so the deadline holds.
_SLICE = 0.5
# Bound on connecting and the MEM_CLIENT handshake (s): the engine's kvproxy
# reached the peer a moment ago, and on failure the write still goes through
# it, within its own write timeout.
_HANDSHAKE = 1.0


class Unavailable(Exception):
    """The direct path cannot say how the write went (the peer hung up, a
    destination it does not list, its answer names dropped bytes): the write
    goes through kvproxy instead, which answers as it always has. Sending the
    same bytes again is harmless. in_sync: the connection may carry on."""

    def __init__(self, msg, in_sync=False):
        super().__init__(msg)
        self.in_sync = in_sync


class Silent(Exception):
    """The peer kvproxy did not answer within the deadline."""


def _timeval(seconds):
    """A socket timeout option's value (at least 1 µs: 0 would mean none)."""
    us = max(int(seconds * 1e6), 1)
    return struct.pack("ll", us // 1000000, us % 1000000)


def _frame(t, payload):
    return _HEAD.pack(b"KV", VERSION, t, len(payload)) + payload


class Peer:
    """A write-only client connection to one peer kvproxy (not thread-safe:
    the caller holds lock)."""

    def __init__(self, addr, timeout, name="engine"):
        host, _, port = addr.rpartition(":")
        self.addr = addr
        self.seq = 0
        self._buf = bytearray()
        deadline = time.monotonic() + min(timeout, _HANDSHAKE)
        try:
            self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout, _HANDSHAKE))
        except (OSError, ValueError) as e:
            raise Unavailable("connect to %s: %s" % (addr, e)) from None
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Blocking with SO_RCVTIMEO/SO_SNDTIMEO, not Python's timeout
            # mode: a reply is then one recv() instead of poll() and recv().
            self.sock.settimeout(None)
            self._wait = 0.0
            self._recv_timeout(_SLICE)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))
            n = name.encode()[:256]
            self._send(_frame(T_MEM_CLIENT, struct.pack("<I", len(n)) + n))
            self._regions(self._read(T_MEM_REGIONS, deadline))
        except BaseException:
            self.close()
            raise

    def close(self):
        self.sock.close()

    def write(self, srcs, dsts, lens, deadline):
        """Writes src[i] -> the peer engine's dst[i] for len[i] bytes of this
        process's memory; returns once the peer has them in its engine's
        memory. Raises Unavailable (go through kvproxy) or Silent."""
        places = self._place(dsts, lens)
        if places is None:  # registered after our table was fetched: ask once
            self.seq += 1
            self._send(_SEQ.pack(b"KV", VERSION, T_MEM_REGIONS_REQ, 8, self.seq))
            self._regions(self._read(T_MEM_REGIONS, deadline, self.seq))
            places = self._place(dsts, lens)
            if places is None:
                raise Unavailable("destination not in the peer's table", in_sync=True)
        self.seq = seq = self.seq + 1
        parts = []
        for (region, off), src, n in zip(places, srcs, lens):
            parts.append(_DATA.pack(b"KV", VERSION, T_DATA, 12 + n, region, off))
            parts.append(ctypes.string_at(src, n))
        parts.append(_SEQ.pack(b"KV", VERSION, T_MEM_FENCE, 8, seq))
        left = deadline - time.monotonic()
        if left < self._wait or (self._wait < _SLICE <= left):
            if left <= 0:
                raise Silent("no time left for %s" % self.addr)
            self._recv_timeout(min(left, _SLICE))
        self._send(b"".join(parts))
        # Mostly the answer is one whole clean MEM_FENCE_ACK, read alone.
        if not self._buf:
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:  # a slice of SO_RCVTIMEO passed
                chunk = None
            except OSError as e:
                raise Unavailable("read from %s: %s" % (self.addr, e)) from None
            if chunk == _ACK_OK.pack(b"KV", VERSION, T_MEM_FENCE_ACK, 12, seq, 0):
                return
            if chunk == b"":
                raise Unavailable("%s hung up" % self.addr)
            if chunk:
                self._buf += chunk
        ack = self._read(T_MEM_FENCE_ACK, deadline, seq)
        err = ack[12:12 + struct.unpack_from("<I", ack, 8)[0]]
        if err:
            self._table = None  # stale: fetched anew next time
            raise Unavailable("peer dropped data: %s" % err.decode(errors="replace"), in_sync=True)

    def _place(self, dsts, lens):
        """(region id, offset) of each destination, or None if one is not in
        a host region of the table."""
        t = self._table
        if t is None:
            return None
        out = []
        for d, n in zip(dsts, lens):
            i = bisect.bisect_right(t[0], d) - 1
            if i < 0:
                return None
            base, end, rid = t[1][i]
            if d + n > end:
                return None
            out.append((rid, d - base))
        return out

    def _regions(self, payload):
        """Installs a MEM_REGIONS payload's host regions."""
        (n,) = struct.unpack_from("<I", payload, 8)
        i, rows = 12, []
        for _ in range(n):
            rid, kind, base, size, _, klen = _REGION.unpack_from(payload, i)
            i += _REGION.size + klen
            if kind == KIND_HOST:
                rows.append((base, base + size, rid))
        if i != len(payload):
            raise Unavailable("malformed MEM_REGIONS from %s" % self.addr)
        rows.sort()
        self._table = ([r[0] for r in rows], rows)

    def _recv_timeout(self, seconds):
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        self._wait = seconds

    def _send(self, b):
        try:
            self.sock.sendall(b)
        except OSError as e:
            raise Unavailable("send to %s: %s" % (self.addr, e)) from None

    def _read(self, want, deadline, seq=None):
        """The payload of the next frame, which must be of type want (and
        answer seq)."""
        buf = self._buf
        while True:
            if len(buf) >= 8:
                magic, version, t, n = _HEAD.unpack_from(buf)
                if magic != b"KV" or version != VERSION or n > _MAX_PAYLOAD:
                    raise Unavailable("malformed frame from %s" % self.addr)
                if len(buf) >= 8 + n:
                    payload = bytes(buf[8:8 + n])
                    del buf[:8 + n]
                    if t != want or (seq is not None and (n < 8 or struct.unpack_from("<Q", payload)[0] != seq)):
                        raise Unavailable("unexpected frame %d from %s" % (t, self.addr))
                    return payload
            left = deadline - time.monotonic()
            if left <= 0:
                raise Silent("no answer from %s" % self.addr)
            # The kernel waits at most a slice, less near the deadline.
            wait = min(left, _SLICE)
            if wait < self._wait or (wait == _SLICE and self._wait < _SLICE):
                self._recv_timeout(wait)
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:  # a slice of SO_RCVTIMEO passed
                continue
            except OSError as e:
                raise Unavailable("read from %s: %s" % (self.addr, e)) from None
            if not chunk:
                raise Unavailable("%s hung up" % self.addr)
            buf += chunk
