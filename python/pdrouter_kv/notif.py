"""NIXL notifications between agents: short messages beside kvproxy's data path.

SGLang up to 0.5.20 learns that a room's KV landed from a NIXL notification
the prefill attaches to its last write; NIXL sends it after the write
completes. kvproxy's control API carries no messages, so an agent that takes
notifications listens on a TCP port named in its metadata, and a sender
writes each one after its transfer's reply came back (the bytes are in the
peer's memory by then). Frame: u32 LE length, u16 LE sender-name length,
sender name, message.
"""

import socket
import struct
import threading

_HEAD = struct.Struct("<IH")
MAX_MESSAGE = 1 << 20


class Inbox:
    """A listening socket and what has come in, by sender."""

    def __init__(self, host):
        self._lock = threading.Lock()
        self._got = {}
        self._conns = set()
        self._closed = False
        self._sock = socket.create_server((host, 0))
        self.address = "%s:%d" % (host, self._sock.getsockname()[1])
        threading.Thread(target=self._accept, name="nixl-notif-accept", daemon=True).start()

    def take(self):
        """Every message since the last take: {sender: [bytes]}."""
        with self._lock:
            got, self._got = self._got, {}
        return got

    def close(self):
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, set()
        for c in [self._sock] + list(conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self):
        while True:
            try:
                c, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    c.close()
                    return
                self._conns.add(c)
            threading.Thread(target=self._read, args=(c,), name="nixl-notif-read", daemon=True).start()

    def _read(self, c):
        buf = bytearray()
        try:
            while True:
                chunk = c.recv(1 << 16)
                if not chunk:
                    return
                buf += chunk
                while len(buf) >= _HEAD.size:
                    n, k = _HEAD.unpack_from(buf)
                    if n > MAX_MESSAGE or k > n - 2:
                        return  # not our peer: drop the connection
                    if len(buf) < 4 + n:
                        break
                    name = bytes(buf[_HEAD.size:_HEAD.size + k]).decode(errors="replace")
                    msg = bytes(buf[_HEAD.size + k:4 + n])
                    del buf[:4 + n]
                    with self._lock:
                        self._got.setdefault(name, []).append(msg)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(c)
            c.close()


class Outbox:
    """One connection per peer inbox, dialled on first use, sent on under a lock each."""

    def __init__(self, name, timeout=10.0):
        self._name = name.encode()
        self._timeout = timeout
        self._lock = threading.Lock()
        self._peers = {}  # address -> [lock, socket or None]

    def send(self, address, msg):
        """Sends msg to the inbox at address; OSError if it cannot be reached."""
        if isinstance(msg, str):
            msg = msg.encode()
        n = 2 + len(self._name) + len(msg)
        if n > MAX_MESSAGE:
            raise ValueError("notification of %d bytes, at most %d" % (len(msg), MAX_MESSAGE - 2 - len(self._name)))
        frame = _HEAD.pack(n, len(self._name)) + self._name + msg
        with self._lock:
            peer = self._peers.setdefault(address, [threading.Lock(), None])
        with peer[0]:
            for attempt in (0, 1):  # a peer that restarted: dial once more
                if peer[1] is None:
                    host, port = address.rsplit(":", 1)
                    peer[1] = socket.create_connection((host, int(port)), timeout=self._timeout)
                try:
                    peer[1].sendall(frame)
                    return
                except OSError:
                    peer[1].close()
                    peer[1] = None
                    if attempt:
                        raise

    def forget(self, address):
        with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            with peer[0]:
                if peer[1] is not None:
                    peer[1].close()

    def close(self):
        with self._lock:
            addresses = list(self._peers)
        for a in addresses:
            self.forget(a)
