"""NIXL descriptor lists and the kvproxy writes a transfer between two of them becomes.

A list is an Nx5 uint64 array of runs (addr, len, dev, stride, count): run r
holds `count` blocks of `len` bytes, `stride` apart, and its blocks take the
flat indices [sum of the counts before r, that + count). An Nx3 list
(addr, len, dev) is the same with count 1 (NIXL 1.5's two forms).

plan() turns (src list, src indices, dst list, dst indices) into page writes
(control.Client.write_pages: buffers x page pairs) where blocks are whole
strides on both sides, and triples for the rest; frames() makes them the
control frames a post sends. SGLang's KV transfer,
make_prepped_xfer over one run per K/V buffer with the same slots in every
buffer (its repeat_indices_over_layers), becomes one page write, and pages
that follow each other on both sides one range per buffer: contiguous pages
ask kvproxy for one copy per buffer, in a request of a few hundred bytes.
"""

import numpy as np

from . import control


class DescError(ValueError):
    """A descriptor list or index that NIXL would refuse."""


def runs(descs):
    """descs (Nx5 or Nx3 array, or a list of 3-tuples) as an Nx5 uint64 array of runs."""
    if isinstance(descs, np.ndarray):
        a = descs
    else:
        a = np.array(list(descs), dtype=object)
        if a.size == 0:
            return np.empty((0, 5), dtype=np.uint64)
    if a.ndim != 2 or a.shape[1] not in (3, 5):
        raise DescError("want an Nx3 (addr, len, dev) or Nx5 (addr, len, dev, stride, count) list, got shape %s" % (a.shape,))
    try:
        if a.dtype.kind not in "ui" and a.dtype != object:
            raise TypeError("dtype %s" % a.dtype)
        if a.dtype == object or a.dtype.kind == "i":
            if (a < 0).any():
                raise DescError("negative address, length or count")
        a = a.astype(np.uint64)
    except (TypeError, OverflowError) as e:
        raise DescError("descriptors must be unsigned 64-bit ints: %s" % e) from None
    if a.shape[1] == 3:
        a = np.column_stack((a, a[:, 1], np.ones(len(a), dtype=np.uint64)))
    if len(a) and (a[:, 1] == 0).any():
        raise DescError("a descriptor of length 0")
    if len(a) and (a[:, 4] == 0).any():
        raise DescError("a strided run of count 0")
    return np.ascontiguousarray(a)


def extents(r):
    """Each run's [start, end) bytes."""
    start = r[:, 0]
    return start, start + r[:, 3] * (r[:, 4] - np.uint64(1)) + r[:, 1]


def inside(r, regions):
    """Whether every run of r lies within one of regions [(addr, len)]."""
    if not len(r):
        return True
    if not regions:
        return False
    regions = sorted(regions)
    starts = np.array([a for a, _ in regions], dtype=np.uint64)
    ends = np.array([a + n for a, n in regions], dtype=np.uint64)
    lo, hi = extents(r)
    i = np.searchsorted(starts, lo, side="right") - 1
    return bool((i >= 0).all() and (hi <= ends[np.maximum(i, 0)]).all())


class DList:
    """A prepared list: its runs, memory kind, owner ("" for local) and flat index table."""

    __slots__ = ("runs", "kind", "agent", "first", "total", "paged", "addrs")

    def __init__(self, r, kind, agent):
        self.runs, self.kind, self.agent = r, kind, agent
        self.addrs = r[:, 0].tolist()  # each run's address, as ints for building writes
        counts = r[:, 4].astype(np.int64)
        self.first = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(r) else np.zeros(0, dtype=np.int64)
        self.total = int(counts.sum())
        # (page length, pages per run) when every run is whole pages of one
        # length and count: SGLang's KV lists, indexed by division.
        uniform = len(r) and (r[:, 1] == r[:, 3]).all() and (r[:, 1] == r[0, 1]).all() and (r[:, 4] == r[0, 4]).all()
        self.paged = (int(r[0, 1]), int(r[0, 4])) if uniform else None

    def locate(self, idx):
        """(run, slot) of each flat index; DescError if one is out of range."""
        if len(idx) and (idx.min() < 0 or idx.max() >= self.total):
            raise DescError("index out of range: the list holds %d descriptors" % self.total)
        run = np.searchsorted(self.first, idx, side="right") - 1
        return run, idx - self.first[run]


def indices(v, what):
    a = np.asarray(v)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "ui"):
        raise DescError("%s: want a 1-D list of ints" % what)
    # SGLang's int32 indices are used as they are: a copy of 32k tokens'
    # indices costs as much as planning them.
    return a if a.dtype in (np.int32, np.int64) else a.astype(np.int64)


def plan(src, src_idx, dst, dst_idx):
    """The writes moving src[src_idx[i]] -> dst[dst_idx[i]] for each i: a list of
    ("pages", buffers, src pages, dst pages) and ("triples", srcs, dsts, lens)."""
    if len(src_idx) != len(dst_idx):
        raise DescError("%d local and %d remote indices" % (len(src_idx), len(dst_idx)))
    fast = _same_pages(src, src_idx, dst, dst_idx)
    if fast is not None:
        return fast
    rs, ks = src.locate(src_idx)
    rd, kd = dst.locate(dst_idx)
    ls, ld = src.runs[rs, 1], dst.runs[rd, 1]
    if (ls != ld).any():
        raise DescError("local and remote descriptors of different lengths")
    # Blocks that fill their stride on both sides are pages of their run.
    paged = (ls == src.runs[rs, 3]) & (ld == dst.runs[rd, 3])
    writes = []
    if paged.any():
        writes += _page_writes(src.runs, dst.runs, rs[paged], ks[paged], rd[paged], kd[paged])
    if not paged.all():
        rest = ~paged
        s = src.runs[rs[rest], 0] + ks[rest].astype(np.uint64) * src.runs[rs[rest], 3]
        d = dst.runs[rd[rest], 0] + kd[rest].astype(np.uint64) * dst.runs[rd[rest], 3]
        writes.append(("triples", s, d, ls[rest]))
    return writes


def _same_pages(src, si, dst, di):
    """SGLang's prepared KV transfer in a few passes over the indices, or None:
    both lists whole pages of one length, the indices rows of one run each,
    every row the same pages (its repeat_indices_over_layers)."""
    if src.paged is None or dst.paged is None or src.paged[0] != dst.paged[0] or not len(si):
        return None
    s, d = _rows(si, src), _rows(di, dst)
    if s is None or d is None or len(s[0]) != len(d[0]):
        return None
    sa, da, n = src.addrs, dst.addrs, src.paged[0]
    return [_pages([(sa[i], da[j], n) for i, j in zip(s[0], d[0])], s[1], d[1])]


def _rows(idx, dl):
    """(run of each row, the rows' pages) when idx is rows of the same pages of one run each, else None."""
    count = dl.paged[1]
    first = int(idx[0])
    if not 0 <= first < dl.total:
        return None
    lo = first - first % count
    width = _row_width(idx, lo, count, len(dl.runs))
    if len(idx) % width:
        return None
    rows = idx.reshape(-1, width)
    pages = rows[0] - lo
    if pages.min() < 0 or pages.max() >= count:
        return None
    # Each row starts at the same page of its run as the first: its run's first index.
    base = rows[:, 0] - (first - lo)
    if base.min() < 0 or base.max() >= dl.total or (base % count).any():
        return None
    # Row k is row 0 moved to its run: one pass over the indices checks every one.
    if not (rows - rows[:, :1] == rows[0] - first).all():
        return None
    return (base // count).tolist(), pages


def _row_width(idx, lo, count, runs):
    """Where idx first leaves the run [lo, lo + count), or a guess at it
    that _rows then checks: SGLang's rows are the same pages in each of the
    list's runs, len(idx) / runs long."""
    n = len(idx)
    guess = n // runs
    if guess and not n % runs and (guess == n or not 0 <= int(idx[guess]) - lo < count):
        return guess
    start, step = 0, 256
    while start < n:
        d = idx[start:start + step] - lo
        # Unsigned, an index below lo is past the run too: one comparison.
        outside = d.view("u%d" % d.itemsize) >= count
        if outside.any():
            return start + int(np.argmax(outside))
        start, step = start + step, 2 * step
    return n


def frames(client, peer, writes):
    """The (op, body) control frames of plan()'s writes, for client.post()."""
    out = []
    for kind, a, b, c in writes:
        if kind == "pages":
            per = max(1, control.MAX_PAGE_WRITE // len(a))
            for i in range(0, len(b), per):
                out += client.write_pages_frames(peer, a, b[i:i + per].tolist(), c[i:i + per].tolist())
        else:
            step = control.MAX_TRIPLES
            out += [control.write_frame(peer, a[i:i + step].tolist(), b[i:i + step].tolist(), c[i:i + step].tolist())
                    for i in range(0, len(a), step)]
    return out


def _page_writes(sruns, druns, rs, ks, rd, kd):
    """Page writes: consecutive indices of one (src run, dst run) pair are a
    buffer's pages; buffers with the same pages share a page write."""
    pair = rs * (len(druns) + 1) + rd
    cut = np.flatnonzero(np.diff(pair)) + 1
    bounds = np.concatenate(([0], cut, [len(pair)]))
    groups = {}  # (page_len, src pages, dst pages) -> buffers
    n = len(bounds) - 1
    width = bounds[1] - bounds[0]
    if (np.diff(bounds) == width).all() and n > 1:
        # SGLang's: every buffer the same slots. One comparison finds it.
        ks2, kd2 = ks.reshape(n, width), kd.reshape(n, width)
        plen = sruns[rs[bounds[:-1]], 1]
        if (ks2 == ks2[0]).all() and (kd2 == kd2[0]).all() and (plen == plen[0]).all():
            buffers = list(zip(sruns[rs[bounds[:-1]], 0].tolist(), druns[rd[bounds[:-1]], 0].tolist(), plen.tolist()))
            return [_pages(buffers, ks2[0], kd2[0])]
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        r, q = rs[a], rd[a]
        key = (int(sruns[r, 1]), ks[a:b].tobytes(), kd[a:b].tobytes())
        groups.setdefault(key, (ks[a:b], kd[a:b], []))[2].append((int(sruns[r, 0]), int(druns[q, 0]), key[0]))
    return [_pages(buffers, sp, dp) for sp, dp, buffers in groups.values()]


def _pages(buffers, sp, dp):
    """The write moving pages sp -> dp of every buffer, with pages that follow
    each other on both sides coalesced: contiguous pages are one range per
    buffer (a page write of one page as long as the run), a few runs a
    triple per buffer and run, and the rest a page write of single pages."""
    s0, d0, n = int(sp[0]), int(dp[0]), len(sp)
    if int(sp[-1]) - s0 == n - 1 and int(dp[-1]) - d0 == n - 1 and n > 1:
        step = (sp[1:] - sp[:-1] == 1) & (dp[1:] - dp[:-1] == 1)
    else:
        step = None
    if n == 1 or (step is not None and step.all()):
        one = np.zeros(1, dtype=np.int64)
        return ("pages", [(s + s0 * size, d + d0 * size, size * n) for s, d, size in buffers], one, one)
    if int(max(sp.max(), dp.max())) >= 1 << 32:
        raise DescError("a slot index past 2^32")
    sp, dp = sp.astype(np.int64, copy=False), dp.astype(np.int64, copy=False)
    cut = np.flatnonzero((sp[1:] - sp[:-1] != 1) | (dp[1:] - dp[:-1] != 1)) + 1
    # Triples take 24 bytes a range, a page write 24 a buffer and 8 a page.
    if 24 * len(buffers) * (len(cut) + 1) > 24 * len(buffers) + 8 * n:
        return ("pages", buffers, sp, dp)
    first = np.concatenate(([0], cut))
    pages = np.diff(np.append(first, n)).astype(np.uint64)
    b = np.array(buffers, dtype=np.uint64)
    src = (b[:, :1] + sp[first].astype(np.uint64) * b[:, 2:]).ravel()
    dst = (b[:, 1:2] + dp[first].astype(np.uint64) * b[:, 2:]).ravel()
    return ("triples", src, dst, (b[:, 2:] * pages).ravel())
