"""TransferEngine.batch_transfer_sync_write sends page-structured batches
(SGLang's: the same page runs in every K/V buffer) as page writes and the
rest as triples, against real kvproxies (host memory: kvproxy moves a page
write of it as its triples). Every byte is checked."""

import ctypes
import logging
import os
import random
import unittest
from unittest import mock

from pdrouter_kv import control, pageplan
from tests.test_engine import EnginePairTest, buffer
from tests.test_pageplan import merged_runs

logging.getLogger("pdrouter_kv").setLevel(logging.CRITICAL)

PAGE = 4096
POOL = 64  # pages a buffer
BUFFERS = 8  # 4 layers x K, V


class _Spy:
    """Counts the control calls a TransferEngine makes."""

    def __init__(self, engine):
        self.client = engine._client
        self.calls = {"write": 0, "write_pages": 0}
        for name in self.calls:
            setattr(self.client, name, self._counting(name, getattr(self.client, name)))

    def _counting(self, name, f):
        def call(*a, **k):
            self.calls[name] += 1
            return f(*a, **k)
        return call


class PageBatchTest(EnginePairTest):
    def setUp(self):
        super().setUp()
        self.session = "127.0.0.1:%d" % self.dst_eng.get_rpc_port()
        self.src = [self.pool(self.src_eng, os.urandom(PAGE * POOL)) for _ in range(BUFFERS + 1)]
        self.dst = [self.pool(self.dst_eng) for _ in range(BUFFERS + 1)]
        self.spy = _Spy(self.src_eng)

    def pool(self, engine, data=None):
        b = buffer(PAGE * POOL)
        if data:
            ctypes.memmove(b, data, len(data))
        self.assertEqual(engine.register_memory(ctypes.addressof(b), len(b)), 0)
        return b

    def sglang(self, runs, buffers=range(BUFFERS)):
        """SGLang's batch: per buffer, a triple per (src page, dst page, pages) run."""
        s, d, n = [], [], []
        for b in buffers:
            sp, dp = ctypes.addressof(self.src[b]), ctypes.addressof(self.dst[b])
            for a, c, k in runs:
                s.append(sp + a * PAGE), d.append(dp + c * PAGE), n.append(k * PAGE)
        return s, d, n

    def send(self, s, d, n):
        """Sends the batch; returns the bytes every destination pool should hold."""
        want = [bytearray(b.raw) for b in self.dst]
        bases = [ctypes.addressof(b) for b in self.src]
        dbases = [ctypes.addressof(b) for b in self.dst]
        for a, c, k in zip(s, d, n):
            i = next(j for j, p in enumerate(bases) if p <= a < p + PAGE * POOL)
            j = next(j for j, p in enumerate(dbases) if p <= c < p + PAGE * POOL)
            want[j][c - dbases[j]:c - dbases[j] + k] = self.src[i].raw[a - bases[i]:a - bases[i] + k]
        self.assertEqual(self.src_eng.batch_transfer_sync_write(self.session, s, d, n), 0)
        return want

    def check(self, want, writes, pages):
        for i, (b, w) in enumerate(zip(self.dst, want)):
            self.assertTrue(b.raw == bytes(w), "destination buffer %d differs" % i)
        self.assertEqual(self.spy.calls, {"write": writes, "write_pages": pages})

    needs_numpy = unittest.skipIf(pageplan.np is None, "numpy missing (the fallback is test_without_numpy...)")

    @needs_numpy
    def test_scattered_pages_go_as_one_page_write(self):
        runs = [(2 * i, 2 * i + 1, 1) for i in range(POOL // 2)]
        self.check(self.send(*self.sglang(runs)), writes=0, pages=1)

    @needs_numpy
    def test_merged_runs_in_sglang_order_go_as_one_page_write(self):
        rnd = random.Random(3)
        src = rnd.sample([p for p in range(POOL) if not 20 <= p < 30], 30)
        dst = rnd.sample([p for p in range(POOL) if not 40 <= p < 50], 30)
        src[5:5], dst[5:5] = range(20, 30), range(40, 50)  # a run of 10 pages
        runs = merged_runs(src, dst)
        self.check(self.send(*self.sglang(runs)), writes=0, pages=1)

    @needs_numpy
    def test_a_batch_of_pages_and_ragged_triples_sends_both(self):
        s, d, n = self.sglang([(2 * i, 2 * i + 1, 1) for i in range(POOL // 2)])
        # The last buffer: ranges that are no pages (odd lengths and offsets).
        sp, dp = ctypes.addressof(self.src[BUFFERS]), ctypes.addressof(self.dst[BUFFERS])
        s += [sp + 1000 * i + 7 for i in range(20)]
        d += [dp + 3000 * i for i in range(20)]
        n += [100 + 37 * i for i in range(20)]
        self.check(self.send(s, d, n), writes=1, pages=1)

    @needs_numpy
    def test_triples_that_are_no_pages_go_as_triples(self):
        rnd = random.Random(5)
        s, d, n = [], [], []
        for b in range(BUFFERS):
            sp, dp = ctypes.addressof(self.src[b]), ctypes.addressof(self.dst[b])
            for i in range(16):
                k = rnd.randint(1, 3000)
                s.append(sp + i * 12000 + rnd.randrange(5000)), d.append(dp + i * 12000 + rnd.randrange(5000)), n.append(k)
        self.check(self.send(s, d, n), writes=1, pages=0)

    def test_without_numpy_or_the_feature_batches_go_as_triples(self):
        runs = [(2 * i, 2 * i + 1, 1) for i in range(POOL // 2)]
        with mock.patch.object(pageplan, "np", None):
            self.check(self.send(*self.sglang(runs)), writes=1, pages=0)
        self.spy.client.features = 0  # an older kvproxy
        runs = [(2 * i + 1, 2 * i, 1) for i in range(POOL // 2)]
        self.check(self.send(*self.sglang(runs)), writes=2, pages=0)

    def test_a_source_outside_the_registrations_fails_and_nothing_moves(self):
        s, d, n = self.sglang([(2 * i, 2 * i + 1, 1) for i in range(POOL // 2)])
        other = buffer(PAGE)
        s[-1] = ctypes.addressof(other)
        self.assertEqual(self.src_eng.batch_transfer_sync_write(self.session, s, d, n), -1)
        self.assertTrue(all(b.raw == b"\0" * len(b) for b in self.dst))

    def test_bad_values_fail_clearly(self):
        s, d, n = self.sglang([(2 * i, 2 * i + 1, 1) for i in range(POOL // 2)])
        self.assertEqual(self.src_eng.batch_transfer_sync_write(self.session, s, d, n[:-1] + [-1]), -1)
        self.assertEqual(self.src_eng.batch_transfer_sync_write(self.session, s, d[:-1] + [1 << 64], n), -1)
        with self.assertRaisesRegex(TypeError, "lengths: want int"):
            self.src_eng.batch_transfer_sync_write(self.session, s, d, n[:-1] + [4096.0])
        with self.assertRaisesRegex(TypeError, "buffers: want a list of int"):
            self.src_eng.batch_transfer_sync_write(self.session, "abc", d, n)
        self.assertTrue(all(b.raw == b"\0" * len(b) for b in self.dst))
        self.assertEqual(self.spy.calls, {"write": 0, "write_pages": 0})

    @needs_numpy
    def test_a_destination_outside_the_peers_registrations_fails(self):
        s, d, n = self.sglang([(2 * i, 2 * i + 1, 1) for i in range(POOL // 2)])
        d[3] = ctypes.addressof(self.dst[0]) + POOL * PAGE * 1000  # page 3 of buffer 0, far away
        self.assertEqual(self.src_eng.batch_transfer_sync_write(self.session, s, d, n), -1)
        self.assertGreaterEqual(self.spy.calls["write_pages"], 1)

    @needs_numpy
    def test_a_refused_page_write_goes_as_triples_to_that_peer_from_then_on(self):
        # As kvproxy refuses a GPU page write whose destinations span several peer regions.
        def refuse(*a, **k):  # moving nothing: the triples must bring every byte
            self.spy.calls["write_pages"] += 1
            raise control.KVProxyError("page write buffer 0: not in one region")
        self.spy.client.write_pages = refuse
        self.check(self.send(*self.sglang([(2 * i, 2 * i + 1, 1) for i in range(POOL // 2)])), writes=1, pages=1)
        self.check(self.send(*self.sglang([(2 * i + 1, 2 * i, 1) for i in range(POOL // 2)])), writes=2, pages=1)

    @needs_numpy
    def test_big_sglang_batch_splits_at_the_frame_limit(self):
        runs = [(2 * i, 2 * i + 1, 1) for i in range(POOL // 2)]
        with mock.patch.object(control, "MAX_PAGE_WRITE", BUFFERS * 10):
            self.check(self.send(*self.sglang(runs)), writes=0, pages=4)


if __name__ == "__main__":
    unittest.main()
