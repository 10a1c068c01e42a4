"""A Mooncake-compatible TransferEngine whose bytes move through kvproxy.

It implements the subset of mooncake.engine.TransferEngine that SGLang's
mooncake disaggregation backend calls, with the same arguments and return
conventions (0 = success, negative = failure). The session id SGLang passes
is "host:rpc_port" of the peer engine, and get_rpc_port() names this engine's
kvproxy peer port, so the session id is the peer kvproxy's peer address.

kvproxy's control socket: $PDROUTER_KVPROXY_SOCK (default /tmp/kvproxy.sock).
"""

import array
import logging
import os
import threading
import time

from . import control, cuda, pageplan, remap

logger = logging.getLogger("pdrouter_kv")

# Mooncake 0.3.13's return codes for the same cases (its error.h; checked
# against its TCP engine): transfers fail with -1 whatever the cause.
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102
ERR_TRANSFER = -1
ERR_NOT_INITIALIZED = -1


def _ints(name, values):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError("%s: want a list of int, got %s" % (name, type(values).__name__))
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError("%s: want int, got %s" % (name, type(v).__name__))
        out.append(v)
    return out


def _u64s(name, values):
    """values as array('Q'), checked in one pass: any int goes, as in
    Mooncake's binding (bool and numpy ints too); OverflowError if one is
    negative or over 64 bits."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError("%s: want a list of int, got %s" % (name, type(values).__name__))
    try:
        return array.array("Q", values)
    except TypeError as e:
        raise TypeError("%s: want int: %s" % (name, e)) from None


def _int(name, v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("%s: want int, got %s" % (name, type(v).__name__))
    return v


def _session(session_id):
    if not isinstance(session_id, str):
        raise TypeError("session_id: want str, got %s" % type(session_id).__name__)
    return session_id


def _overlapping(ranges):
    ranges = sorted(ranges)
    return any(a + n > b for (a, n), (b, _) in zip(ranges, ranges[1:]))


class TransferEngine:
    """mooncake.engine.TransferEngine over kvproxy.

    If kvproxy goes away, calls fail at once (negative, the cause logged)
    and a watcher thread dials the same socket again (every
    RECONNECT_INTERVAL, backing off to RECONNECT_MAX) until it is back, then
    registers every region again: an engine that makes no calls (decode,
    whose memory peers write into) is served again too. Give kvproxy a fixed
    --peer-port so the session id peers hold stays right.
    """

    RECONNECT_INTERVAL = 0.5
    RECONNECT_MAX = 2.0

    def __init__(self):
        self._client = None
        self._initialized = False
        self._last_dial = 0.0
        self._peer_addr = None
        self.transport = None
        self._down_logged = False  # kvproxy unreachable, said once
        self._stop = None  # set to stop the watcher
        self._watcher = None
        self._sock_path = None
        self._lock = threading.RLock()
        # Registered engine ranges (ptr -> length); the page-aligned
        # segments kvproxy holds (start -> (size, memfd kept for
        # re-registering)), several ranges may share one segment (small
        # buffers on the same page); device ranges (ptr -> length).
        self._ranges = {}
        self._segments = {}
        self._cuda = {}
        self._triples_only = set()  # peers that refused a page write the triples of which went

    # Set-up.

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Connects to kvproxy. The arguments are Mooncake's; kvproxy's own
        flags choose the transport, so protocol and device are not used."""
        for name, v in (("local_hostname", local_hostname), ("metadata_server", metadata_server), ("protocol", protocol), ("device_name", device_name)):
            if not isinstance(v, str):
                raise TypeError("initialize: %s: want str, got %s" % (name, type(v).__name__))
        with self._lock:
            if self._initialized:
                return 0
            # Read once: reconnects go to the same kvproxy.
            self._sock_path = os.environ.get("PDROUTER_KVPROXY_SOCK", control.DEFAULT_SOCK)
            if self._dial() is None:
                return -1
            self._initialized = True
            self._stop = threading.Event()
            self._watcher = threading.Thread(target=self._watch, args=(self._stop,), name="pdrouter-kv-watch", daemon=True)
            self._watcher.start()
        return 0

    def _watch(self, stop):
        """Notices kvproxy hanging up and reconnects, backing off while it stays down."""
        delay = self.RECONNECT_INTERVAL
        while not stop.is_set():
            client = self._client
            if client is not None:
                if not client.alive(self.RECONNECT_INTERVAL):
                    if stop.is_set():  # close() shut the socket
                        return
                    self._lost(client, control.ControlClosed("kvproxy hung up"))
                    logger.warning("TransferEngine: kvproxy at %s went away; reconnecting", client.sock_path)
                continue
            try:
                if self._conn() is not None:
                    delay = self.RECONNECT_INTERVAL
                    continue
            except Exception:  # whatever it was, the engine must not stop reconnecting
                logger.exception("TransferEngine: reconnecting to kvproxy")
            stop.wait(delay)
            delay = min(2 * delay, self.RECONNECT_MAX)

    def _dial(self):
        self._last_dial = time.monotonic()
        try:
            client = control.Client(self._sock_path, timeout=float(os.environ.get("PDROUTER_KVPROXY_TIMEOUT", "30")))
        except OSError as e:
            if not self._down_logged:  # the watcher retries: say it once
                logger.error("TransferEngine: %s (calls fail until it is back)", e)
                self._down_logged = True
            return None
        try:
            self._peer_addr, self.transport = client.hello()
            for start, (size, fd) in self._segments.items():
                client.register_memory(start, size, fd)
            for p, n in list(self._cuda.items()):
                try:
                    client.register_cuda_memory(p, n)
                except (ValueError, RuntimeError, control.KVProxyError) as e:  # RuntimeError: CudaError, CudaUnavailable
                    # Its allocation went, or the driver or kvproxy refuse it:
                    # it would fail every reconnect, so the rest goes on without it.
                    logger.error("TransferEngine: device memory [%#x,+%d) not registered again, dropped: %s", p, n, e)
                    del self._cuda[p]
        except (OSError, control.KVProxyError, cuda.CudaError) as e:
            logger.error("TransferEngine: kvproxy at %s: %s", client.sock_path, e)
            client.close()
            return None
        self._client = client
        self._down_logged = False
        return client

    def _conn(self):
        """The live control connection, re-dialled (rate-limited) after kvproxy went away."""
        client = self._client
        if client is not None and not client.alive():
            self._lost(client, control.ControlClosed("kvproxy hung up"))
            client = None
        if client is not None or not self._initialized:
            return client
        with self._lock:
            if self._initialized and self._client is None and time.monotonic() - self._last_dial >= self.RECONNECT_INTERVAL:
                if self._dial() is not None:
                    logger.warning("TransferEngine: reconnected to kvproxy, %d regions registered again", len(self._segments) + len(self._cuda))
            return self._client

    def _lost(self, client, err):
        if isinstance(err, control.ControlClosed):
            with self._lock:
                if self._client is client:
                    self._client = None
            client.close()

    def get_rpc_port(self):
        if self._peer_addr is None:
            return -1
        return int(self._peer_addr.rsplit(":", 1)[1])

    def get_engine(self):
        return self

    def peer_address(self):
        """This engine's kvproxy's "host:port" for peers (None before initialize)."""
        return self._peer_addr

    def control(self):
        """The live control connection to kvproxy (re-dialled after it went
        away), or None while it is unreachable."""
        return self._conn()

    def close(self):
        """Drops the control connection; kvproxy unregisters everything with it."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
            watcher, self._stop, self._watcher = self._watcher, None, None
            client, self._client = self._client, None
            self._initialized = False
            for _, fd in self._segments.values():
                os.close(fd)
            self._ranges.clear()
            self._segments.clear()
            self._cuda.clear()
        if client is not None:
            client.close()  # wakes the watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(5)

    # Memory.

    def register_memory(self, buffer_addr, capacity):
        return self.batch_register_memory([buffer_addr], [capacity])

    def batch_register_memory(self, buffer_addresses, capacities):
        ptrs = _ints("buffer_addresses", buffer_addresses)
        lens = _ints("capacities", capacities)
        if len(ptrs) != len(lens):
            raise ValueError("batch_register_memory: %d addresses, %d capacities" % (len(ptrs), len(lens)))
        client = self._conn()
        if client is None:
            return ERR_NOT_INITIALIZED
        try:
            spans = [remap.page_span(p, n) for p, n in zip(ptrs, lens)]
            on_gpu = [cuda.is_cuda_pointer(p) for p in ptrs]
        except (ValueError, cuda.CudaError) as e:
            logger.error("batch_register_memory: %s", e)
            return ERR_INVALID_ARGUMENT
        with self._lock:
            if _overlapping(list(zip(ptrs, lens)) + list(self._ranges.items()) + list(self._cuda.items())):
                logger.error("batch_register_memory: overlapping memory regions")
                return ERR_ADDRESS_OVERLAPPED
            try:
                self._register_spans(client, [s for s, g in zip(spans, on_gpu) if not g])
                for p, n, g in zip(ptrs, lens, on_gpu):
                    if g:
                        client.register_cuda_memory(p, n)
                        self._cuda[p] = n
            except (OSError, ValueError, control.KVProxyError, cuda.CudaError) as e:
                logger.error("batch_register_memory: %s", e)
                self._lost(client, e)
                return -1
            for p, n, g in zip(ptrs, lens, on_gpu):
                if not g:
                    self._ranges[p] = n
        return 0

    def _register_spans(self, client, spans):
        # A new span overlapping registered segments replaces them by their
        # union (remapping a page twice would detach it from the first memfd).
        merged = remap.merge_spans(spans + [(s, n) for s, (n, _) in self._segments.items()])
        for start, size in merged:
            if start in self._segments and self._segments[start][0] == size:
                continue
            old = [s for s, (n, _) in self._segments.items() if s < start + size and start < s + n]
            # Unregistered first, so kvproxy cannot write into a memfd the
            # remap is about to detach (a write there would be lost unseen).
            gone = []
            try:
                for s in old:
                    client.unregister_memory(s)
                    gone.append(s)
                fd = remap.remap(start, size)
            except BaseException:
                # remap maps nothing when it fails: the old memfds still back their pages.
                for s in gone:
                    client.register_memory(s, *self._segments[s])
                raise
            # Now the new memfd backs their pages: it is what a reconnect registers.
            for s in old:
                os.close(self._segments.pop(s)[1])
            self._segments[start] = (size, fd)
            try:
                client.register_memory(start, size, fd)
            except control.KVProxyError:
                os.close(self._segments.pop(start)[1])  # refused: a later registration remaps it again
                raise

    def unregister_memory(self, buffer_addr):
        return self.batch_unregister_memory([buffer_addr])

    def batch_unregister_memory(self, buffer_addresses):
        ptrs = _ints("buffer_addresses", buffer_addresses)
        if not self._initialized:
            return ERR_NOT_INITIALIZED
        client = self._conn()
        ret = 0

        def unregister(addr):
            nonlocal ret, client
            if client is None:
                return  # kvproxy is gone, and with it what we had registered
            try:
                client.unregister_memory(addr)
            except (OSError, control.KVProxyError) as e:
                logger.error("unregister_memory: %s", e)
                self._lost(client, e)
                if isinstance(e, control.ControlClosed):
                    client = None  # the rest went with the connection; else they are still there
                ret = -1

        with self._lock:
            for p in ptrs:
                if self._cuda.pop(p, None) is not None:
                    unregister(p)
                elif self._ranges.pop(p, None) is None:
                    logger.error("unregister_memory: %#x is not registered", p)
                    ret = ERR_ADDRESS_NOT_REGISTERED
            live = [remap.page_span(p, n) for p, n in self._ranges.items()]
            for start, (size, fd) in list(self._segments.items()):
                if any(s < start + size and start < s + n for s, n in live):
                    continue
                unregister(start)
                del self._segments[start]
                os.close(fd)
        return ret

    # Transfers.

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length):
        return self.batch_transfer_sync_write(target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        """Writes each local buffer into the peer engine's memory; returns 0 once
        every byte is in the peer's memory, negative on any failure."""
        peer = _session(target_hostname)
        try:
            srcs = _u64s("buffers", buffers)
            dsts = _u64s("peer_buffer_addresses", peer_buffer_addresses)
            lens = _u64s("lengths", lengths)
        except OverflowError as e:
            logger.warning("batch_transfer_sync_write to %s: addresses and lengths must be unsigned 64-bit ints: %s", peer, e)
            return ERR_TRANSFER
        if not len(srcs) == len(dsts) == len(lens):
            raise ValueError("batch_transfer_sync_write: %d buffers, %d peer addresses, %d lengths" % (len(srcs), len(dsts), len(lens)))
        client = self._conn()
        if client is None:
            return ERR_NOT_INITIALIZED
        if not srcs:
            return 0
        # Page-structured batches (SGLang's: the same page runs in every K/V
        # buffer) go as page writes, what is left as triples.
        writes, (s, d, n) = (), (srcs, dsts, lens)
        if len(srcs) >= pageplan.MIN_TRIPLES and (client.features or 0) & control.FEATURE_WRITE_PAGES and peer not in self._triples_only:
            with self._lock:
                regions = list(self._ranges.items()) + list(self._cuda.items())
            found = pageplan.plan(srcs, dsts, lens, regions, control.MAX_PAGE_WRITE)
            if found is not None:
                writes, (s, d, n) = found
        # kvproxy checks both ends against the registrations: an address
        # outside them fails the call (a batch with a source outside every
        # region goes as triples only, so then nothing moves).
        refused = False
        try:
            try:
                for buffers, src_pages, dst_pages in writes:
                    client.write_pages(peer, buffers, src_pages, dst_pages)
            except control.KVProxyError as e:
                # kvproxy moves a GPU buffer's pages within one region of the
                # peer's: destinations over several go as triples (all of
                # them again: the same bytes), to this peer from now on.
                logger.info("batch_transfer_sync_write to %s: page write refused (%s), sending triples", peer, e)
                refused, (s, d, n) = True, (srcs, dsts, lens)
            for i in range(0, len(s), control.MAX_TRIPLES):
                j = i + control.MAX_TRIPLES
                client.write(peer, s[i:j], d[i:j], n[i:j])
        except (OSError, ValueError, control.KVProxyError) as e:
            logger.warning("batch_transfer_sync_write to %s: %s", peer, e)
            self._lost(client, e)
            return ERR_TRANSFER
        if refused:
            self._triples_only.add(peer)
        return 0

    def send_probe(self, target_hostname):
        peer = _session(target_hostname)
        client = self._conn()
        if client is None:
            return ERR_NOT_INITIALIZED
        try:
            client.probe(peer)
        except (OSError, ValueError, control.KVProxyError) as e:
            logger.info("send_probe %s: %s", peer, e)
            self._lost(client, e)
            return ERR_SOCKET
        return 0
