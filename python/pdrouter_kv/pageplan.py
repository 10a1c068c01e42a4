"""Finds page writes in a batch of (src, dst, len) triples.

SGLang's mooncake backend sends one triple per run of pages per K/V buffer
(its group_concurrent_contiguous), buffer after buffer, the same page runs in
every buffer. kvproxy moves that as a page write (control.Client.write_pages:
buffers x page pairs, OP_WRITE_PAGES) far faster on the GPU than as triples
and in a frame 1/3 x buffers as long. plan() recovers it, vectorised with
numpy: triples are grouped by the registered region holding their source;
in a group, the page length is the gcd of the lengths and of the offsets
from the group's lowest source and destination, so every triple is a run of
whole pages; groups with the same runs in page units share one page write.
Whatever does not fit stays a triple.
"""

import array

try:
    import numpy as np
except ImportError:  # then every batch goes as triples
    np = None

# A group's runs become a page write only while its pages are at most this
# many times its triples: kvproxy expands page writes of host memory into a
# triple per page, and long runs move as fast as triples anyway.
MAX_PAGES_PER_TRIPLE = 2
# Page writes one batch may become before the rest goes as triples.
MAX_WRITES = 16
# Smaller batches go as triples: nothing to gain.
MIN_TRIPLES = 64

_U32 = 1 << 32


def plan(srcs, dsts, lens, regions, max_ranges):
    """Splits a batch into page writes and leftover triples.

    srcs, dsts, lens: array('Q'); regions: (start, length)
    of each registered local range; max_ranges: the most buffers x pairs one
    page write may name. Returns (writes, rest) with writes a list of
    (buffers, src_pages, dst_pages) as control.Client.write_pages takes them
    and rest the (srcs, dsts, lens) left over (array('Q')), or None when the batch is
    better sent as it is (no numpy, too small, nothing fits, or a source
    outside every region: kvproxy then refuses the batch whole).
    """
    if np is None or len(srcs) < MIN_TRIPLES or not regions:
        return None
    s, d, n = (np.frombuffer(v, dtype=np.uint64) for v in (srcs, dsts, lens))
    regions = sorted(regions)
    # g: 1 + the index of the region holding each source (0: none).
    starts = np.array([r[0] for r in regions], dtype=np.uint64)
    ends = np.array([0] + [r[0] + r[1] for r in regions], dtype=np.uint64)
    g = np.searchsorted(starts, s, side="right")
    if g.min() == 0 or max(s.max(), n.max()) >= 1 << 63:  # below 2^63, s + n cannot wrap
        return None
    if ((s + n) > ends[g]).any():
        return None
    zero = np.flatnonzero(n == 0) if n.min() == 0 else np.empty(0, dtype=np.intp)  # zero-length triples stay triples
    order = None
    if len(zero):
        order = np.setdiff1d(np.arange(len(g)), zero, assume_unique=True)
    step = np.diff(g if order is None else g[order])
    if len(step) and step.min() < 0:
        # SGLang's come buffer after buffer, each in the same order; others
        # are put so (by source within a buffer) to find the same runs.
        order = np.arange(len(g)) if order is None else order
        order = order[np.lexsort((s[order], g[order]))]
        step = None
    if order is not None:
        if not len(order):
            return None
        g = g[order]
        if step is None:
            step = np.diff(g)
    first = np.r_[0, np.flatnonzero(step) + 1]
    counts = np.diff(np.r_[first, len(g)])
    writes, rest = [], [zero]
    for c in np.unique(counts).tolist():
        groups = np.flatnonzero(counts == c)
        if len(groups) == len(first):
            rows = np.arange(len(g)).reshape(len(groups), c)
        else:
            rows = first[groups][:, None] + np.arange(c)
        idx = rows if order is None else order[rows]
        if order is None and len(groups) == len(first):  # SGLang's: views, no gathers
            cols = [v.reshape(rows.shape) for v in (s, d, n)]
        else:
            cols = [v[idx] for v in (s, d, n)]
        w, left = _group_writes(*cols, max_ranges, MAX_WRITES - len(writes))
        writes += w
        rest.append(idx[left].ravel())
    if not writes:
        return None
    rest = np.concatenate(rest)
    return writes, tuple(array.array("Q", v[rest].tobytes()) for v in (s, d, n))


def _group_writes(s, d, n, max_ranges, max_writes):
    """Page writes for buffers of the same number of triples (a row each:
    [buffers, triples] arrays); returns them and the rows left over.

    Rows with the same offsets from their lowest source and destination
    and the same lengths have the same runs: they are compared so, and only
    one row of each kind is turned into pages."""
    smin, dmin = s.min(axis=1), d.min(axis=1)
    so, do = s - smin[:, None], d - dmin[:, None]
    left = np.arange(len(s))
    writes, used = [], np.zeros(len(s), dtype=bool)
    for _ in range(max_writes):
        if not len(left) or len(writes) >= max_writes:
            break
        ref = left[0]
        rows = (lambda m: m) if len(left) == len(s) else (lambda m: m[left])  # no copy the first time
        same = (rows(so) == so[ref]).all(axis=1) & (rows(do) == do[ref]).all(axis=1) & (rows(n) == n[ref]).all(axis=1)
        bucket, left = left[same][:max_ranges], left[~same]  # beyond max_ranges (never seen): triples
        runs = _runs(so[ref], do[ref], n[ref])
        if runs is not None:
            used[bucket] = True
            writes += _page_writes(bucket, *runs, smin, dmin, max_ranges)
    return writes, ~used


def _runs(so, do, n):
    """One row's triples as runs of pages (src page, dst page, pages, page
    length), or None if its pages would be too many or their indexes past u32."""
    # The shortest triple is a page if it divides everything; else the gcd.
    page = int(n.min())
    if ((so | do | n) % np.uint64(page)).any():
        page = int(np.gcd.reduce(np.gcd(np.gcd(n, so), do)))
    p = np.uint64(page)
    sp, dp, cnt = so // p, do // p, n // p
    if int(cnt.sum()) > MAX_PAGES_PER_TRIPLE * len(n) or int(max(sp.max(), dp.max()) + cnt.max()) > _U32:
        return None
    return sp, dp, cnt, page


def _page_writes(bucket, sp, dp, cnt, page, smin, dmin, max_ranges):
    """The runs (sp, dp, cnt) expanded into page pairs, for every buffer of
    bucket, in as many page writes as max_ranges asks."""
    cnt = cnt.astype(np.int64)
    total = int(cnt.sum())
    within = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    src_pages = (np.repeat(sp.astype(np.int64), cnt) + within).tolist()
    dst_pages = (np.repeat(dp.astype(np.int64), cnt) + within).tolist()
    buffers = [(int(smin[i]), int(dmin[i]), page) for i in bucket.tolist()]
    step = max(1, max_ranges // len(buffers))
    return [(buffers, src_pages[i:i + step], dst_pages[i:i + step]) for i in range(0, total, step)]
