"""The nixl look-alike (pdrouter_kv.agent) against two real kvproxies, called as SGLang's nixl backend calls it."""

import gc
import mmap
import os
import signal
import threading
import time
import unittest

try:
    import numpy as np
except ImportError:
    np = None

from tests.kvproxy_proc import KVProxy
from tests.test_reconnect import free_port, wait_for

if np is not None:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    from nixl._bindings import (nixlInvalidParamError, nixlNotFoundError, nixlNotPostedError,
                                nixlNotSupportedError, nixlRepostActiveError)
    from pdrouter_kv import agent as agent_mod, control, xferplan

needs_numpy = unittest.skipIf(np is None, "numpy missing: SGLang's nixl backend needs it (run with the SGLang venv)")

_maps = []


def host_array(nbytes, fill=0):
    """uint8 numpy view of pages of its own (two agents of one process must not remap one page)."""
    m = mmap.mmap(-1, nbytes)
    _maps.append(m)
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = fill
    return a


def agent_on(kp, name, threads=0):
    os.environ["PDROUTER_KVPROXY_SOCK"] = kp.sock
    cfg = nixl_agent_config(backends=[], num_threads=threads, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    a = nixl_agent(name, cfg)
    a.create_backend("UCX", {"num_threads": str(threads)} if threads else {})
    return a


class stopped:
    """kvproxy stopped (SIGSTOP) for the block: it reads and answers nothing.
    Waits until every thread of it is stopped, so nothing slips through."""

    def __init__(self, kp):
        self.pid = kp.p.pid

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        tasks = "/proc/%d/task" % self.pid

        def state(t):
            with open(os.path.join(tasks, t, "stat")) as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        wait_for(lambda: all(state(t) == "T" for t in os.listdir(tasks)), 5)

    def __exit__(self, *exc):
        os.kill(self.pid, signal.SIGCONT)


def settle(agent, handles, timeout=20):
    """Polls as SGLang's _await_handles does; returns each handle's last state."""
    end = time.monotonic() + timeout
    while True:
        states = [agent.check_xfer_state(h) for h in handles]
        if all(s != "PROC" for s in states) or time.monotonic() > end:
            return states
        time.sleep(0)


def ranges(writes):
    """Every (src, dst, len) range the writes name, in order."""
    out = []
    for kind, a, b, c in writes:
        if kind == "pages":
            out += [(s + i * n, d + j * n, n) for s, d, n in a for i, j in zip(b.tolist(), c.tolist())]
        else:
            out += list(zip(a.tolist(), b.tolist(), c.tolist()))
    return out


def moved(writes):
    """The bytes the writes move, as {src byte: dst byte} runs: writes that move
    the same bytes to the same places, however cut into ranges, compare equal."""
    out = {}
    for s, d, n in ranges(writes):
        out.update({s + k: d + k for k in range(0, n, 16)})  # 16: the smallest block in these tests
    return out


@needs_numpy
class PlanTest(unittest.TestCase):
    """Descriptor lists and the writes they become, without kvproxy."""

    def dlist(self, rows, agent=""):
        return xferplan.DList(xferplan.runs(np.array(rows, dtype=np.uint64)), "VRAM", agent)

    def test_strided_and_expanded_lists_index_the_same_blocks(self):
        strided = self.dlist([(1000, 16, 0, 32, 4), (9000, 8, 0, 8, 2)])
        expanded = self.dlist([(1000, 16, 0), (1032, 16, 0), (1064, 16, 0), (1096, 16, 0), (9000, 8, 0), (9008, 8, 0)])
        self.assertEqual(strided.total, 6)
        self.assertEqual(expanded.total, 6)
        for d in (strided, expanded):
            run, slot = d.locate(np.array([0, 3, 4, 5]))
            addr = d.runs[run, 0] + slot.astype(np.uint64) * d.runs[run, 3]
            self.assertEqual(addr.tolist(), [1000, 1096, 9000, 9008])
        with self.assertRaisesRegex(xferplan.DescError, "out of range"):
            strided.locate(np.array([6]))
        with self.assertRaisesRegex(xferplan.DescError, "out of range"):
            strided.locate(np.array([-1]))

    def test_sglang_kv_transfer_is_one_page_write_of_every_buffer(self):
        # 4 K/V buffers of 10 slots of 64 bytes each side; SGLang's
        # repeat_indices_over_layers over pages [2, 3, 7] -> [5, 6, 1].
        src = self.dlist([(b, 64, 0, 64, 10) for b in (0x10000, 0x20000, 0x30000, 0x40000)])
        dst = self.dlist([(b, 64, 0, 64, 12) for b in (0x90000, 0xA0000, 0xB0000, 0xC0000)], "peer")
        si = (np.arange(4)[:, None] * 10 + np.array([2, 3, 7])).ravel()
        di = (np.arange(4)[:, None] * 12 + np.array([5, 6, 1])).ravel()
        writes = xferplan.plan(src, si, dst, di)
        self.assertEqual(len(writes), 1)
        kind, buffers, sp, dp = writes[0]
        self.assertEqual(kind, "pages")
        self.assertEqual(buffers, [(0x10000, 0x90000, 64), (0x20000, 0xA0000, 64), (0x30000, 0xB0000, 64), (0x40000, 0xC0000, 64)])
        self.assertEqual((sp.tolist(), dp.tolist()), ([2, 3, 7], [5, 6, 1]))

    def test_the_shortcut_for_sglangs_lists_plans_what_the_general_way_does(self):
        rng = np.random.default_rng(7)
        src = self.dlist([(0x100000 * (b + 1), 64, 0, 64, 50) for b in range(8)])
        dst = self.dlist([(0x9000000 * (b + 1), 64, 0, 64, 40) for b in range(8)], "peer")

        def general(dl):  # the same list without the shortcut
            g = xferplan.DList(dl.runs, dl.kind, dl.agent)
            g.paged = None
            return g

        cases = []
        for _ in range(20):  # SGLang's: the same pages in every run
            pages = rng.choice(40, size=int(rng.integers(1, 40)), replace=False)
            runs = rng.choice(8, size=int(rng.integers(1, 9)), replace=False)
            cases.append(((runs[:, None] * 50 + pages).ravel(), (runs[:, None] * 40 + pages).ravel()))
        # Not SGLang's: other pages per run, a row across two runs, rows of two widths.
        cases.append((np.array([1, 2, 51, 53]), np.array([1, 2, 41, 43])))
        cases.append((np.array([48, 49, 50, 51]), np.array([0, 1, 2, 3])))
        cases.append((np.array([1, 2, 51]), np.array([1, 2, 41])))
        for si, di in cases:
            fast = xferplan.plan(src, si, dst, di)
            slow = xferplan.plan(general(src), si, general(dst), di)
            self.assertEqual(moved(fast), moved(slow), (si, di))
            self.assertEqual(sum(n for _, _, n in ranges(fast)), 64 * len(si))
        self.assertEqual(len(xferplan.plan(src, cases[0][0], dst, cases[0][1])), 1, "SGLang's transfer is one page write")
        with self.assertRaisesRegex(xferplan.DescError, "out of range"):
            xferplan.plan(src, np.array([1, 51, 401]), dst, np.array([1, 41, 81]))

    def test_buffers_with_different_pages_and_partial_blocks(self):
        src = self.dlist([(0x10000, 64, 0, 64, 10), (0x20000, 64, 0, 64, 10), (0x30000, 16, 0, 64, 10)])
        dst = self.dlist([(0x90000, 64, 0, 64, 10), (0xA0000, 64, 0, 64, 10), (0xB0000, 16, 0, 64, 10)], "peer")
        writes = xferplan.plan(src, np.array([1, 2, 13, 21]), dst, np.array([4, 5, 18, 29]))
        pages = sorted((w[1], w[2].tolist(), w[3].tolist()) for w in writes if w[0] == "pages")
        # Pages 1-2 -> 4-5 follow each other on both sides: one range.
        self.assertEqual(pages, [([(0x10000 + 64, 0x90000 + 4 * 64, 128)], [0], [0]), ([(0x20000 + 3 * 64, 0xA0000 + 8 * 64, 64)], [0], [0])])
        triples = [w for w in writes if w[0] == "triples"]
        self.assertEqual(len(triples), 1)
        _, s, d, n = triples[0]
        # Blocks shorter than their stride go one by one.
        self.assertEqual((s.tolist(), d.tolist(), n.tolist()), ([0x30000 + 64], [0xB0000 + 9 * 64], [16]))

    def test_pages_that_follow_each_other_are_one_range_per_buffer_and_run(self):
        # SGLang's layout in small: 8 K/V buffers of 100 slots, the same pages in each.
        src = self.dlist([(0x1000000 * (b + 1), 64, 0, 64, 100) for b in range(8)])
        dst = self.dlist([(0x90000000 + 0x1000000 * b, 64, 0, 64, 120) for b in range(8)], "peer")

        def plan(sp, dp):
            sp, dp = np.array(sp), np.array(dp)
            si = (np.arange(8)[:, None] * 100 + sp).ravel().astype(np.int32)
            di = (np.arange(8)[:, None] * 120 + dp).ravel().astype(np.int32)
            writes = xferplan.plan(src, si, dst, di)
            want = {src.runs[b, 0] + 64 * s + k: dst.runs[b, 0] + 64 * d + k for b in range(8) for s, d in zip(sp, dp) for k in range(0, 64, 16)}
            self.assertEqual(moved(writes), want)
            return writes

        contiguous = plan(range(10, 74), range(50, 114))
        self.assertEqual(ranges(contiguous), [(0x1000000 * (b + 1) + 640, 0x90000000 + 0x1000000 * b + 3200, 64 * 64) for b in range(8)])
        self.assertEqual(contiguous[0][0], "pages", "kvproxy moves GPU pages so")
        # Two runs (pages 0-39 -> 0-39 and 60-99 -> 40-79): a range per buffer and run.
        two = plan(list(range(40)) + list(range(60, 100)), range(80))
        self.assertEqual(len(ranges(two)), 8 * 2)
        # Every other page: nothing follows, and single pages make the shorter request.
        scattered = plan(range(0, 100, 2), range(1, 101, 2))
        self.assertEqual([w[0] for w in scattered], ["pages"])
        self.assertEqual(len(ranges(scattered)), 8 * 50)

    def test_refusals(self):
        src = self.dlist([(0x10000, 64, 0, 64, 4)])
        dst = self.dlist([(0x90000, 32, 0, 32, 4)], "peer")
        with self.assertRaisesRegex(xferplan.DescError, "different lengths"):
            xferplan.plan(src, np.array([0]), dst, np.array([0]))
        with self.assertRaisesRegex(xferplan.DescError, "1 local and 2 remote"):
            xferplan.plan(src, np.array([0]), dst, np.array([0, 1]))
        with self.assertRaisesRegex(xferplan.DescError, "Nx3"):
            xferplan.runs(np.zeros((2, 4), dtype=np.uint64))
        with self.assertRaisesRegex(xferplan.DescError, "length 0"):
            xferplan.runs([(4096, 0, 0)])
        with self.assertRaisesRegex(xferplan.DescError, "negative"):
            xferplan.runs([(-1, 10, 0)])
        self.assertTrue(xferplan.inside(xferplan.runs([(100, 10, 0, 20, 3)]), [(100, 50)]))
        self.assertFalse(xferplan.inside(xferplan.runs([(100, 10, 0, 20, 3)]), [(100, 49)]))
        self.assertFalse(xferplan.inside(xferplan.runs([(100, 10, 0)]), []))


SLOTS, SLOT = 64, 4096  # per buffer
BUFFERS = 6


@needs_numpy
class AgentTest(unittest.TestCase):
    """A prefill agent (the initiator) and a decode agent, each on its own kvproxy."""

    @classmethod
    def setUpClass(cls):
        cls.kp = [KVProxy("prefill", extra=["--peer-port", str(free_port())]),
                  KVProxy("decode", extra=["--peer-port", str(free_port())])]

    @classmethod
    def tearDownClass(cls):
        for k in cls.kp:
            k.stop()

    def setUp(self):
        self.p = agent_on(self.kp[0], "prefill-agent", threads=8)
        self.d = agent_on(self.kp[1], "decode-agent")
        self.src = [host_array(SLOTS * SLOT) for _ in range(BUFFERS)]
        self.dst = [host_array(SLOTS * SLOT) for _ in range(BUFFERS)]
        for b, a in enumerate(self.src):
            a.reshape(SLOTS, SLOT)[:] = (np.arange(SLOTS)[:, None] * 7 + b * 31 + np.arange(SLOT)[None, :] % 5) % 251
        # SGLang registers its KV pool as VRAM even when it is host memory (CPU runs).
        self.assertTrue(self.p.register_memory([(a.ctypes.data, a.nbytes, 0, "") for a in self.src], "VRAM"))
        self.assertTrue(self.d.register_memory([(a.ctypes.data, a.nbytes, 0, "") for a in self.dst], "VRAM"))
        self.assertEqual(self.p.add_remote_agent(self.d.get_agent_metadata()), "decode-agent")

    def tearDown(self):
        self.p.close()
        self.d.close()
        # A completer ends once its peer has nothing in flight (it may still be returning).
        wait_for(lambda: not [t for t in threading.enumerate() if t.name == "nixl-completer"], 5)
        for k in self.kp:
            self.assertEqual(k.wait_metric("kvproxy_registered_regions", 0), 0, "regions left in kvproxy after close")

    def strided(self, arrays, slots=SLOTS):
        return np.array([(a.ctypes.data, SLOT, 0, SLOT, slots) for a in arrays], dtype=np.uint64)

    def expanded(self, arrays):
        rows = [(a.ctypes.data + i * SLOT, SLOT, 0) for a in arrays for i in range(SLOTS)]
        return np.array(rows, dtype=np.uint64)

    def idx(self, pages):
        return (np.arange(BUFFERS, dtype=np.int32)[:, None] * SLOTS + np.asarray(pages, dtype=np.int32)).ravel().astype(np.int32)

    def check_pages(self, src_pages, dst_pages):
        for b in range(BUFFERS):
            s, d = self.src[b].reshape(SLOTS, SLOT), self.dst[b].reshape(SLOTS, SLOT)
            np.testing.assert_array_equal(d[dst_pages], s[src_pages], "buffer %d" % b)

    def prepped(self, src_pages, dst_pages, strided=True, notif=b""):
        if strided:
            sh = self.p.prep_xfer_dlist("", self.strided(self.src), "VRAM")
            dh = self.p.prep_xfer_dlist("decode-agent", self.strided(self.dst), "VRAM")
        else:
            sh = self.p.prep_xfer_dlist("", self.p.get_xfer_descs(self.expanded(self.src), "VRAM"), "VRAM")
            dh = self.p.prep_xfer_dlist("decode-agent", self.p.get_xfer_descs(self.expanded(self.dst), "VRAM"), "VRAM")
        return self.p.make_prepped_xfer("WRITE", sh, self.idx(src_pages), dh, self.idx(dst_pages), notif_msg=notif)

    def test_strided_prepped_write_lands_every_page(self):
        src_pages, dst_pages = [3, 4, 5, 9, 60], [10, 11, 12, 2, 63]
        h = self.prepped(src_pages, dst_pages)
        self.assertIn(self.p.transfer(h), ("PROC", "DONE"))
        self.assertEqual(settle(self.p, [h]), ["DONE"])
        self.check_pages(src_pages, dst_pages)
        untouched = sorted(set(range(SLOTS)) - set(dst_pages))
        self.assertFalse(any(self.dst[b].reshape(SLOTS, SLOT)[untouched].any() for b in range(BUFFERS)))

    def test_expanded_nx3_lists_move_the_same_bytes(self):
        # SGLang's fallback for a NIXL without strided lists: one descriptor per block.
        h = self.prepped([0, 1, 2, 40], [7, 8, 9, 1], strided=False)
        self.assertEqual(self.p.transfer(h), "PROC")
        self.assertEqual(settle(self.p, [h]), ["DONE"])
        self.check_pages([0, 1, 2, 40], [7, 8, 9, 1])

    def test_initialize_xfer_with_tuples_and_nx3(self):
        aux_s, aux_d = host_array(8192, 0x5A), host_array(8192)
        self.p.register_memory([(aux_s.ctypes.data, 8192, 0, "")], "DRAM")
        self.d.register_memory([(aux_d.ctypes.data, 8192, 0, "")], "DRAM")
        self.p.add_remote_agent(self.d.get_agent_metadata())  # the decode registered after its first metadata
        h = self.p.initialize_xfer("WRITE", self.p.get_xfer_descs([(aux_s.ctypes.data + 100, 300, 0)], "DRAM"),
                                   self.p.get_xfer_descs([(aux_d.ctypes.data + 4000, 300, 0)], "DRAM"), "decode-agent")
        self.assertEqual(self.p.transfer(h), "PROC")
        s, d = self.src[1], self.dst[2]
        rows = np.array([(s.ctypes.data + 5 * SLOT, SLOT, 0), (s.ctypes.data + 6 * SLOT, 100, 0)], dtype=np.uint64)
        rows_d = np.array([(d.ctypes.data, SLOT, 0), (d.ctypes.data + 9 * SLOT + 1, 100, 0)], dtype=np.uint64)
        h2 = self.p.initialize_xfer("WRITE", self.p.get_xfer_descs(rows, "VRAM"), self.p.get_xfer_descs(rows_d, "VRAM"), "decode-agent")
        self.assertEqual(self.p.transfer(h2), "PROC")
        self.assertEqual(settle(self.p, [h, h2]), ["DONE", "DONE"])
        self.assertTrue((aux_d[4000:4300] == 0x5A).all())
        self.assertFalse(aux_d[:4000].any() or aux_d[4300:].any())
        np.testing.assert_array_equal(d[:SLOT], s[5 * SLOT:6 * SLOT])
        np.testing.assert_array_equal(d[9 * SLOT + 1:9 * SLOT + 101], s[6 * SLOT:6 * SLOT + 100])

    def test_check_xfer_state_never_waits(self):
        h = self.prepped([1, 2], [3, 4])
        with self.assertRaises(nixlNotPostedError):
            self.p.check_xfer_state(h)
        with stopped(self.kp[0]):
            self.assertEqual(self.p.transfer(h), "PROC")
            t0 = time.monotonic()
            for _ in range(100):
                self.assertEqual(self.p.check_xfer_state(h), "PROC")
            # A bound against a hang, not a speed claim: one check is microseconds.
            self.assertLess(time.monotonic() - t0, 2.0)
            with self.assertRaises(nixlRepostActiveError):
                self.p.transfer(h)
        self.assertEqual(settle(self.p, [h]), ["DONE"])
        self.check_pages([1, 2], [3, 4])
        # A finished transfer may be posted again (NIXL allows it).
        self.src[0][SLOT:2 * SLOT] = 99
        self.assertEqual(self.p.transfer(h), "PROC")
        self.assertEqual(settle(self.p, [h]), ["DONE"])
        self.check_pages([1, 2], [3, 4])

    def test_completion_by_notification_comes_after_the_bytes(self):
        # SGLang <= 0.5.20: the decode learns of the room from a notif on the last write.
        pages = list(range(20, 50))
        h = self.prepped(pages, pages, notif=b"42_kv_0_1_0")
        self.assertEqual(self.p.transfer(h), "PROC")
        got = {}
        wait_for(lambda: got.update(self.d.get_new_notifs()) or got, 10)
        self.assertEqual(got, {"prefill-agent": [b"42_kv_0_1_0"]})
        self.check_pages(pages, pages)  # landed before the notif was sent
        self.p.send_notif("decode-agent", b"42_aux")
        self.assertTrue(wait_for(lambda: self.d.check_remote_xfer_done("prefill-agent", b"42_a"), 10) >= 0)
        self.assertEqual(self.d.get_new_notifs(), {})
        # SGLang 0.5.23: no notif_msg, nothing arrives.
        h2 = self.prepped([1], [1])
        self.p.transfer(h2)
        self.assertEqual(settle(self.p, [h2]), ["DONE"])
        time.sleep(0.2)
        self.assertEqual(self.d.get_new_notifs(), {})

    def test_a_transfer_with_a_notification_is_done_only_once_it_went_out(self):
        # SGLang <= 0.5.20 concludes a room's prefill on DONE and its decode on the
        # notification: DONE must not come before the notification is sent, nor
        # turn into ERR when it cannot be.
        outbox = self.p._core.outbox
        at_notif, release = threading.Event(), threading.Event()

        def unreachable_inbox(address, msg):
            at_notif.set()
            release.wait(10)
            raise OSError("the decode's inbox is gone")

        outbox.send = unreachable_inbox
        h = self.prepped([1, 2], [1, 2], notif=b"7_kv_0_1_0")
        self.assertEqual(self.p.transfer(h), "PROC")
        self.assertTrue(at_notif.wait(10))
        self.check_pages([1, 2], [1, 2])  # the bytes landed; the notification has not gone
        self.assertEqual(self.p.check_xfer_state(h), "PROC")
        release.set()
        self.assertEqual(settle(self.p, [h]), ["ERR"])
        del outbox.send  # the real one again
        self.assertEqual(self.p.transfer(h), "PROC")
        self.assertEqual(settle(self.p, [h]), ["DONE"])
        got = {}
        wait_for(lambda: got.update(self.d.get_new_notifs()) or got, 10)
        self.assertEqual(got, {"prefill-agent": [b"7_kv_0_1_0"]})

    def test_a_hung_peer_holds_up_no_other_peers_transfers(self):
        # One prefill serves several decodes; one whose kvproxy hangs must not
        # hold the others' DONE and notifications until its write times out.
        kp2 = KVProxy("decode", extra=["--peer-port", str(free_port())])
        d2 = agent_on(kp2, "decode-b")
        try:
            dst2 = host_array(SLOTS * SLOT)
            d2.register_memory([(dst2.ctypes.data, dst2.nbytes, 0, "")], "VRAM")
            self.assertEqual(self.p.add_remote_agent(d2.get_agent_metadata()), "decode-b")
            sh = self.p.prep_xfer_dlist("", self.strided(self.src[:1]), "VRAM")
            dh = self.p.prep_xfer_dlist("decode-b", self.strided([dst2]), "VRAM")
            with stopped(self.kp[1]):
                hung = self.prepped([1], [1], notif=b"1_kv_0_1_0")
                self.assertEqual(self.p.transfer(hung), "PROC")
                time.sleep(0.2)  # the write to the stopped kvproxy is on its way
                h = self.p.make_prepped_xfer("WRITE", sh, np.array([3], dtype=np.int32), dh, np.array([4], dtype=np.int32), "2_kv_0_1_0")
                self.assertEqual(self.p.transfer(h), "PROC")
                # Bounds against the old wait, the write timeout (30 s), not speed claims.
                self.assertEqual(settle(self.p, [h], timeout=10), ["DONE"])
                got = {}
                wait_for(lambda: got.update(d2.get_new_notifs()) or got, 10)
                self.assertEqual(got, {"prefill-agent": [b"2_kv_0_1_0"]})
                np.testing.assert_array_equal(dst2.reshape(SLOTS, SLOT)[4], self.src[0].reshape(SLOTS, SLOT)[3])
                self.assertEqual(self.p.check_xfer_state(hung), "PROC")
            # Resumed, the hung write lands or meets kvproxy's write timeout; either way it ends.
            self.assertIn(settle(self.p, [hung]), (["DONE"], ["ERR"]))
        finally:
            d2.close()
            kp2.stop()

    def test_a_peers_completer_serves_its_posts_and_ends_when_idle(self):
        # Transfers with a notification (SGLang <= 0.5.20) end in a completer,
        # which sends it. A thread started per post would add its start-up to SGLang's post.
        self.addCleanup(setattr, agent_mod, "COMPLETER_IDLE_S", agent_mod.COMPLETER_IDLE_S)
        agent_mod.COMPLETER_IDLE_S = 1.0

        def completers():
            return [t for t in threading.enumerate() if t.name == "nixl-completer"]

        seen = []
        for pages in ([1], [2], [3]):
            h = self.prepped(pages, pages, notif=b"%d_kv_0_1_0" % pages[0])
            self.assertEqual(self.p.transfer(h), "PROC")
            self.assertEqual(settle(self.p, [h]), ["DONE"])
            seen += completers()
        self.assertEqual(len(set(seen)), 1, "one completer for the peer, kept between posts")
        wait_for(lambda: not completers(), 10)
        h = self.prepped([4], [4], notif=b"4_kv_0_1_0")  # the next post starts one again
        self.assertEqual(self.p.transfer(h), "PROC")
        self.assertEqual(settle(self.p, [h]), ["DONE"])
        self.check_pages([1, 2, 3, 4], [1, 2, 3, 4])

    def test_a_transfer_without_a_notification_ends_in_the_thread_that_polls(self):
        # SGLang 0.5.23's: no thread between kvproxy's reply and check_xfer_state.
        posts = []
        client = self.p._engine().control()
        real = client.post

        def post(op, body, fd=None):
            posts.append((op, body))
            return real(op, body, fd)

        client.post = post
        self.addCleanup(delattr, client, "post")
        pages = list(range(8, 40))  # contiguous on both sides
        h = self.prepped(pages, [p + 20 for p in pages])
        self.assertEqual(self.p.transfer(h), "PROC")
        self.assertEqual(settle(self.p, [h]), ["DONE"])
        self.assertFalse([t for t in threading.enumerate() if t.name == "nixl-completer"])
        self.check_pages(pages, [p + 20 for p in pages])
        # One request naming one range per buffer: its pages coalesced, not one range a page.
        self.assertEqual(len(posts), 1)
        op, body = posts[0]
        self.assertEqual(op, control.OP_WRITE_PAGES)
        at = 4 + int.from_bytes(body[:4], "little")  # past the peer's name
        buffers = int.from_bytes(body[at:at + 4], "little")
        at += 4 + 24 * buffers
        pairs = int.from_bytes(body[at:at + 4], "little")
        self.assertEqual((buffers, pairs), (BUFFERS, 1))

    def test_a_transfer_kvproxy_does_not_answer_is_an_err_at_its_deadline(self):
        self.p._core.timeout = 0.5
        h = self.prepped([1], [1])
        with stopped(self.kp[0]):
            self.assertEqual(self.p.transfer(h), "PROC")
            self.assertEqual(self.p.check_xfer_state(h), "PROC")
            t0 = time.monotonic()
            self.assertEqual(settle(self.p, [h], timeout=10), ["ERR"])
            self.assertGreaterEqual(time.monotonic() - t0, 0.3)
        # kvproxy carries it out once resumed; the connection serves on.
        h2 = self.prepped([2], [2])
        self.assertEqual(self.p.transfer(h2), "PROC")
        self.assertEqual(settle(self.p, [h2]), ["DONE"])
        self.check_pages([1, 2], [1, 2])

    def test_many_threads_post_and_poll_at_once(self):
        # SGLang's 4 transfer workers and bootstrap thread share one agent.
        errors = []
        sh = self.p.prep_xfer_dlist("", self.strided(self.src), "VRAM")
        dh = self.p.prep_xfer_dlist("decode-agent", self.strided(self.dst), "VRAM")

        def worker(t):
            try:
                for round_ in range(10):
                    pages = [t * 8 + (round_ + k) % 8 for k in range(3)]
                    hs = [self.p.make_prepped_xfer("WRITE", sh, self.idx(pages), dh, self.idx(pages))]
                    for h in hs:
                        if self.p.transfer(h) == "ERR":
                            errors.append("post")
                    if settle(self.p, hs) != ["DONE"]:
                        errors.append("state")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(errors, [])
        self.check_pages(list(range(64)), list(range(64)))
        sh = dh = None  # noqa: F841 - dropped for the check below
        gc.collect()
        wait_for(lambda: self.p.held() == (0, 0, 0), 10)

    def test_handles_are_freed_when_dropped(self):
        sh = self.p.prep_xfer_dlist("", self.strided(self.src), "VRAM")
        dh = self.p.prep_xfer_dlist("decode-agent", self.strided(self.dst), "VRAM")
        h = self.p.make_prepped_xfer("WRITE", sh, self.idx([5]), dh, self.idx([6]))
        self.assertEqual(self.p.held(), (2, 1, 0))
        del sh, dh  # a transfer made from them does not need them
        gc.collect()
        self.assertEqual(self.p.held(), (0, 1, 0))
        with stopped(self.kp[0]):
            self.assertEqual(self.p.transfer(h), "PROC")
            del h  # dropped in flight, as SGLang drops its handles
            gc.collect()
            self.assertEqual(self.p.held(), (0, 0, 1), "the handle's state outlived it")
        wait_for(lambda: self.p.held() == (0, 0, 0), 10)
        self.check_pages([5], [6])  # the write went on to completion
        # A handle dropped once its transfer ended leaves nothing to settle,
        # however long nobody asks (SGLang drops every handle so).
        for pages in ([7], [8]):
            h = self.p.make_prepped_xfer("WRITE", self.p.prep_xfer_dlist("", self.strided(self.src), "VRAM"), self.idx(pages),
                                         self.p.prep_xfer_dlist("decode-agent", self.strided(self.dst), "VRAM"), self.idx(pages))
            self.assertEqual(self.p.transfer(h), "PROC")
            self.assertEqual(settle(self.p, [h]), ["DONE"])
            del h
        gc.collect()
        self.assertEqual(len(self.p._core.orphans), 0)

    def test_refusals(self):
        with self.assertRaises(nixlNotFoundError):
            self.p.prep_xfer_dlist("nobody", self.strided(self.dst), "VRAM")
        with self.assertRaises(nixlNotFoundError):  # past the decode's registered memory
            self.p.prep_xfer_dlist("decode-agent", self.strided(self.dst, SLOTS + 1), "VRAM")
        with self.assertRaises(nixlNotFoundError):  # registered as VRAM, not DRAM
            self.p.prep_xfer_dlist("decode-agent", self.strided(self.dst), "DRAM")
        with self.assertRaises(nixlNotSupportedError):
            self.p.register_memory([(self.src[0].ctypes.data, 10, 0, "")], "FILE")
        with self.assertRaisesRegex(ValueError, "mem type"):
            self.p.prep_xfer_dlist("", self.strided(self.src))
        sh = self.p.prep_xfer_dlist("", self.strided(self.src), "VRAM")
        dh = self.p.prep_xfer_dlist("decode-agent", self.strided(self.dst), "VRAM")
        with self.assertRaises(nixlNotSupportedError):
            self.p.make_prepped_xfer("READ", sh, [0], dh, [0])
        with self.assertRaises(nixlInvalidParamError):
            self.p.make_prepped_xfer("WRITE", sh, [BUFFERS * SLOTS], dh, [0])
        with self.assertRaises(nixlInvalidParamError):
            self.p.make_prepped_xfer("WRITE", dh, [0], sh, [0])
        with self.assertRaises(nixlInvalidParamError):
            self.p.add_remote_agent(b"not metadata")
        self.assertTrue(self.p.check_remote_metadata("decode-agent"))
        self.p.remove_remote_agent("decode-agent")
        self.assertFalse(self.p.check_remote_metadata("decode-agent"))
        with self.assertRaises(nixlNotFoundError):
            self.p.remove_remote_agent("decode-agent")

    def test_a_dead_peer_kvproxy_fails_the_transfer_and_a_restarted_one_serves_again(self):
        h = self.prepped([1], [1])
        regions = self.kp[1].metric("kvproxy_registered_regions")
        self.kp[1].kill()
        self.assertIn(self.p.transfer(h), ("PROC", "ERR"))
        self.assertEqual(settle(self.p, [h]), ["ERR"])
        self.kp[1].start()
        wait_for(lambda: self.kp[1].metric("kvproxy_registered_regions") == regions, 10)
        # As SGLang does after a failed batch: the metadata it holds is still good.
        self.assertTrue(self.p.check_remote_metadata("decode-agent"))
        wait_for(lambda: self.p.transfer(h) != "ERR" and settle(self.p, [h]) == ["DONE"], 10)
        self.check_pages([1], [1])
