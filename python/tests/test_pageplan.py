import array
import random
import unittest

from pdrouter_kv import control, pageplan

REGION = 1 << 24


def canonical(triples):
    """The triples with ranges following on both sides merged, sorted: two
    lists moving the same bytes to the same places are equal so."""
    runs, zero = {}, []  # (src end, dst end) -> [src, dst, len]
    for s, d, n in sorted(triples):
        if not n:
            zero.append((s, d, n))
            continue
        r = runs.pop((s, d), None) or [s, d, 0]
        r[2] += n
        runs[(r[0] + r[2], r[1] + r[2])] = r
    return sorted([tuple(r) for r in runs.values()] + zero)


def expand(writes, rest):
    """Every triple the page writes and leftovers name."""
    out = list(zip(*rest))
    for buffers, src_pages, dst_pages in writes:
        for src, dst, page in buffers:
            out += [(src + s * page, dst + d * page, page) for s, d in zip(src_pages, dst_pages)]
    return out


def sglang_batch(buffers, runs, page=32768, src_base=0x7F0000000000, dst_base=0x7E0000000000):
    """SGLang's batch: per buffer, a triple per run (src page, dst page, pages)."""
    s, d, n = [], [], []
    for b in range(buffers):
        for sp, dp, k in runs:
            s.append(src_base + b * REGION + sp * page)
            d.append(dst_base + b * REGION + dp * page)
            n.append(k * page)
    return s, d, n, [(src_base + b * REGION, REGION) for b in range(buffers)]


def merged_runs(src_pages, dst_pages):
    """group_concurrent_contiguous: pages following on both sides merge."""
    runs = []
    for a, b in zip(src_pages, dst_pages):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return runs


@unittest.skipIf(pageplan.np is None, "numpy missing: batches go as triples (TransferEngine's tests cover that)")
class PlanTest(unittest.TestCase):
    def plan(self, s, d, n, regions, max_ranges=control.MAX_PAGE_WRITE):
        found = pageplan.plan(*(array.array("Q", v) for v in (s, d, n)), regions, max_ranges)
        if found is not None:
            found = found[0], tuple(list(v) for v in found[1])
            self.assertEqual(canonical(expand(*found)), canonical(zip(s, d, n)), "the plan must move exactly the batch's bytes")
        return found

    def test_scattered_pages_are_one_page_write(self):
        runs = [(2 * i, 2 * i + 1, 1) for i in range(100)]
        s, d, n, regions = sglang_batch(64, runs)
        writes, rest = self.plan(s, d, n, regions)
        self.assertEqual(len(writes), 1)
        self.assertEqual(rest, ([], [], []))
        buffers, src_pages, dst_pages = writes[0]
        self.assertEqual(len(buffers), 64)
        self.assertEqual(buffers[1], (0x7F0000000000 + REGION, 0x7E0000000000 + REGION + 32768, 32768))
        self.assertEqual((src_pages[:2], dst_pages[:2]), ([0, 2], [0, 2]))

    def test_runs_of_several_pages_and_shuffled_order(self):
        rnd = random.Random(1)
        src = rnd.sample(range(4000), 600)
        dst = sorted(rnd.sample(range(4000), 600))
        runs = merged_runs(sorted(src[:300]) + src[300:], dst)
        s, d, n, regions = sglang_batch(10, runs, page=4096)
        order = list(range(len(s)))
        rnd.shuffle(order)
        s, d, n = [s[i] for i in order], [d[i] for i in order], [n[i] for i in order]
        writes, rest = self.plan(s, d, n, regions)
        self.assertEqual((len(writes), rest), (1, ([], [], [])))
        self.assertEqual(len(writes[0][1]), 600)

    def test_a_buffer_with_other_runs_is_a_page_write_of_its_own(self):
        runs = [(2 * i, 2 * i + 1, 1) for i in range(80)]
        s, d, n, regions = sglang_batch(8, runs)
        other = sglang_batch(1, [(3 * i, i, 1) for i in range(80)], src_base=0x7D0000000000)
        writes, rest = self.plan(s + other[0], d + other[1], n + other[2], regions + other[3])
        self.assertEqual(sorted(len(w[0]) for w in writes), [1, 8])
        self.assertEqual(rest, ([], [], []))

    def test_what_does_not_fit_stays_triples(self):
        runs = [(2 * i, 2 * i + 1, 1) for i in range(80)]
        s, d, n, regions = sglang_batch(4, runs)
        # One buffer with ragged lengths (gcd 8: 3 pages a triple average > 2).
        ragged = sglang_batch(1, [(0, 0, 1)] * 80, src_base=0x7D0000000000)
        rs = [ragged[0][0] + 40000 * i for i in range(80)]
        rd = [ragged[1][0] + 40000 * i for i in range(80)]
        rn = [32768 + 8 * (i % 3) for i in range(80)]
        # And a zero-length triple.
        writes, rest = self.plan(s + rs + [s[0]], d + rd + [d[0]], n + rn + [0], regions + ragged[3])
        self.assertEqual([len(w[0]) for w in writes], [4])
        self.assertEqual(sorted(zip(*rest)), sorted(list(zip(rs, rd, rn)) + [(s[0], d[0], 0)]))

    def test_long_runs_are_better_as_triples(self):
        # Contiguous pages: one triple a buffer; a page write would name 2048x the ranges.
        s, d, n, regions = sglang_batch(64, [(0, 0, 2048)])
        self.assertIsNone(self.plan(s, d, n, regions))
        runs = [(10 * i, 10 * i, 1 + i % 9) for i in range(40)]  # 5 pages a triple
        self.assertIsNone(self.plan(*sglang_batch(64, runs)))
        # Runs of one length are pages of that length.
        writes, _ = self.plan(*sglang_batch(64, [(10 * i, 10 * i, 5) for i in range(40)]))
        self.assertEqual((writes[0][0][0][2], writes[0][1][:2]), (5 * 32768, [0, 2]))

    def test_batches_it_must_leave_alone(self):
        runs = [(2 * i, 2 * i + 1, 1) for i in range(80)]
        s, d, n, regions = sglang_batch(4, runs)
        self.assertIsNone(self.plan(s[:63], d[:63], n[:63], regions), "small batches go as they are")
        self.assertIsNone(self.plan(s + [0x1000], d + [0x1000], n + [4096], regions), "a source outside every region")
        self.assertIsNone(self.plan(s[:-1] + [s[-1] + REGION - 100], d, n, regions), "a triple past its region's end")
        self.assertIsNone(self.plan(s, d, n, []))
        # Page indexes past u32 (1-byte pages 2^33 apart): triples.
        far = [(0, 0, 1), (1 << 33, 1, 1)] * 40
        self.assertIsNone(self.plan(*sglang_batch(1, far, page=1)))

    def test_writes_split_at_max_ranges(self):
        runs = [(2 * i, 2 * i + 1, 1) for i in range(100)]
        s, d, n, regions = sglang_batch(16, runs)
        writes, rest = self.plan(s, d, n, regions, max_ranges=16 * 30)
        self.assertEqual([len(w[1]) for w in writes], [30, 30, 30, 10])

    def test_random_batches_are_covered_exactly(self):
        rnd = random.Random(7)
        for _ in range(200):
            bufs = rnd.randint(1, 6)
            page = rnd.choice([1, 24, 4096, 32768])
            runs = [(rnd.randrange(500), rnd.randrange(500), rnd.randint(1, 3)) for _ in range(rnd.randint(10, 40))]
            s, d, n, regions = sglang_batch(bufs, runs, page=page)
            for _ in range(rnd.randint(0, 5)):  # perturb: a triple moved, resized or dropped
                i = rnd.randrange(len(s))
                s[i] += rnd.choice([0, page, 8])
                n[i] = max(0, n[i] + rnd.choice([0, -8, page]))
                if rnd.random() < 0.2:
                    del s[i], d[i], n[i]
            if len(s) >= pageplan.MIN_TRIPLES:
                self.plan(s, d, n, regions)


if __name__ == "__main__":
    unittest.main()
