"""SGLang's own mooncake or nixl PD backend (0.5.23; 0.5.20 too, sglang_versions.py), outside a server, moving real KV.

`worker` runs one side (prefill or decode) the way SGLang's scheduler does:
SGLang's MHATokenToKVPool and MetadataBuffers on CPU, KVArgs filled by SGLang's
own _init_kv_manager, the backend's KVManager/Sender/Receiver, SGLang's bootstrap
server (or kvproxy's). Whichever `mooncake.engine` (or `nixl`) is first on
sys.path moves the bytes: Mooncake's (NIXL's) real one or pdrouter's
(python/mooncake, python/nixl).

Both sides read one plan (rooms and prompt lengths). Prefill fills each
request's pages with a pattern derived from (room, layer, K/V, token) and
sends them in chunks; decode checks every page and the aux row on arrival.
Each side writes a JSON result: per-request state, timings, bytes.
"""

import argparse
import json
import os
import sys
import threading
import time
import types

import sglang_versions

PAGE_SIZE = 16


def log(*a):
    print("[%s %s]" % (os.environ.get("HARNESS_ROLE", "?"), time.strftime("%H:%M:%S")), *a, file=sys.stderr, flush=True)


def write_model_dir(path, layers, kv_heads, head_dim):
    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": kv_heads * head_dim * 4, "num_attention_heads": kv_heads * 4,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": layers,
        "intermediate_size": 256, "vocab_size": 32000, "max_position_embeddings": 65536,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


class Side:
    """One SGLang scheduler's KV transfer state: pools, manager, page allocator."""

    def __init__(self, a):
        import torch
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.disaggregation.utils import MetadataBuffers, TransferBackend

        self.torch, self.a, self.role = torch, a, a.role
        write_model_dir(a.model_dir, a.layers, a.kv_heads, a.head_dim)
        sa = ServerArgs(
            model_path=a.model_dir, device="cpu", tp_size=1, page_size=PAGE_SIZE,
            disaggregation_mode=a.role, disaggregation_transfer_backend=a.backend,
            disaggregation_bootstrap_port=a.bootstrap_port, host="127.0.0.1",
            skip_tokenizer_init=True, load_format="dummy",
        )
        self.version, row = sglang_versions.current()
        self.sender_args = row.sender_args
        scheduler_extra = row.runtime(sa, a.dist_port)
        self.server_args = sa
        self.bootstrap = None
        if a.role == "prefill" and a.sglang_bootstrap:
            from sglang.srt.managers.disagg_service import start_disagg_service
            self.bootstrap = start_disagg_service()
        model_config = ModelConfig.from_server_args(sa)
        pool_pages = a.pool_tokens // PAGE_SIZE
        self.kv_pool = MHATokenToKVPool(
            size=pool_pages * PAGE_SIZE, page_size=PAGE_SIZE, dtype=torch.bfloat16,
            head_num=a.kv_heads, head_dim=a.head_dim, layer_num=a.layers, device="cpu",
            enable_memory_saver=False, start_layer=0, end_layer=a.layers,
        )
        self.metadata = MetadataBuffers(a.aux_slots, hidden_size=model_config.hidden_size,
                                        hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=16)
        fake = types.SimpleNamespace(
            transfer_backend=TransferBackend(a.backend), tp_rank=0, pp_rank=0, is_mla_backend=False, enable_staging=False,
            token_to_kv_pool=self.kv_pool, draft_token_to_kv_pool=None, metadata_buffers=self.metadata,
            scheduler=types.SimpleNamespace(
                rust_server=None, enable_hisparse=False, model_config=model_config, server_args=sa,
                tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(kv_cache_dtype_str="bfloat16")),
                **scheduler_extra,
            ),
        )
        if a.backend == "nixl" and a.nixl_host_as_dram:
            # Real NIXL refuses host memory registered as VRAM (SGLang's kind
            # for the KV pool, host memory here); the look-alike takes it as it comes.
            import sglang.srt.disaggregation.nixl.conn as nixl_conn
            nixl_conn._normalize_kv_mem_kinds = lambda kinds, n: ["DRAM"] * n
        if a.role == "prefill":
            from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue as Q
        else:
            from sglang.srt.disaggregation.decode import DecodePreallocQueue as Q
        self.mgr = Q._init_kv_manager(fake)
        self.kv_args = self.mgr.kv_args
        # Page 0 is SGLang's padding page; hand out the rest.
        self.free_pages = list(range(1, pool_pages))
        self.free_aux = list(range(a.aux_slots))
        self.lock = threading.Lock()
        # Views of every K and V buffer as [pages, page_size * per_token] int16.
        self.bufs = []
        for layer in range(a.layers):
            for t in (self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer]):
                self.bufs.append(t.view(torch.int16).reshape(-1, PAGE_SIZE * a.kv_heads * a.head_dim))
        self.bytes_per_page = sum(self.kv_args.kv_item_lens)
        self._count_engine_calls()

    def _count_engine_calls(self):
        """Times every batch_transfer_sync SGLang makes (its wrapper of the engine),
        or with nixl each post: making the transfer request and posting it."""
        self.calls = [0, 0.0, 0, 0, 0.0]  # calls, seconds, bytes, ranges, of the seconds making nixl requests
        self.notifs = 0  # NIXL notifications the nixl backend took (SGLang <= 0.5.20 completes by them)
        lock = threading.Lock()
        if self.a.backend == "nixl":
            agent = self.mgr.agent

            def timed_call(name, making):
                inner = getattr(agent, name)

                def call(*args, **kw):
                    t = time.perf_counter()
                    try:
                        return inner(*args, **kw)
                    finally:
                        dt = time.perf_counter() - t
                        with lock:
                            self.calls[0] += 0 if making else 1
                            self.calls[1] += dt
                            self.calls[4] += dt if making else 0
                setattr(agent, name, call)

            inner_notifs = agent.get_new_notifs

            def counted_notifs(*args, **kw):
                got = inner_notifs(*args, **kw)
                with lock:
                    self.notifs += sum(len(m) for m in got.values())
                return got

            agent.get_new_notifs = counted_notifs
            for name in ("make_prepped_xfer", "initialize_xfer"):
                timed_call(name, True)
            timed_call("transfer", False)
            return
        te = self.mgr.engine
        inner = te.batch_transfer_sync

        def timed(session_id, srcs, dsts, lens):
            t = time.perf_counter()
            ret = inner(session_id, srcs, dsts, lens)
            dt = time.perf_counter() - t
            with lock:
                self.calls[0] += 1
                self.calls[1] += dt
                self.calls[2] += sum(lens)
                self.calls[3] += len(lens)
            return ret

        te.batch_transfer_sync = timed

    def alloc(self, n):
        with self.lock:
            if len(self.free_pages) < n or not self.free_aux:
                return None, None
            pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
            return pages, self.free_aux.pop()

    def free(self, pages, aux):
        with self.lock:
            self.free_pages.extend(pages)
            self.free_aux.append(aux)

    def width(self):
        """Values of each page row that are filled and checked: all, or 32 with --fill sample."""
        return self.bufs[0].shape[1] if self.a.fill == "full" else 32

    def pattern(self, room, b, pages_count):
        """Buffer b's [pages, width] int16 pattern for one request, the same on both
        sides: it differs per room, buffer, page and position in the page."""
        torch = self.torch
        w = self.width()
        base = (room * 2654435761 + b * 40503) & 0x7FFF
        page = torch.arange(pages_count, dtype=torch.int16).mul_(w + 7).view(-1, 1)
        pos = torch.arange(w, dtype=torch.int16).view(1, -1)
        return (page + pos).add_(base)  # int16 arithmetic wraps, fine for a pattern

    @staticmethod
    def runs(pages):
        """(offset in the request, first page, count) for each run of consecutive pages."""
        out, i = [], 0
        while i < len(pages):
            j = i
            while j + 1 < len(pages) and pages[j + 1] == pages[j] + 1:
                j += 1
            out.append((i, pages[i], j - i + 1))
            i = j + 1
        return out

    def fill(self, room, pages):
        w, runs = self.width(), self.runs(pages)
        for b, buf in enumerate(self.bufs):
            pat = self.pattern(room, b, len(pages))
            for i, p, n in runs:
                buf[p:p + n, :w] = pat[i:i + n]

    def check(self, room, pages):
        """Number of (buffer, page) rows that differ from the pattern."""
        w, runs, bad = self.width(), self.runs(pages), 0
        for b, buf in enumerate(self.bufs):
            pat = self.pattern(room, b, len(pages))
            for i, p, n in runs:
                if not self.torch.equal(buf[p:p + n, :w], pat[i:i + n]):
                    bad += int((buf[p:p + n, :w] != pat[i:i + n]).any(dim=1).sum())
        return bad

    def clear(self, pages):
        w = self.width()
        for _, p, n in self.runs(pages):
            for buf in self.bufs:
                buf[p:p + n, :w] = 0


def kv_class(a, kind):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    return get_kv_class(TransferBackend(a.backend), getattr(KVClassType, kind))


def held(a, i):
    """A fault phase holds the rooms after the first a.hold["after"] in
    WaitingForInput until the driver has struck (its file exists), so the
    fault always meets rooms still to move, however fast the others went."""
    h = a.hold
    if not h or i < h["after"]:
        return False
    if os.path.exists(h["until"]):
        a.hold = None
        return False
    return True


def run_prefill(side, plan, a, res):
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    KVSender = kv_class(a, "SENDER")

    boot = "127.0.0.1:%d" % a.bootstrap_port
    pending = list(plan)
    live = {}
    deadline_s = a.request_timeout
    chunk_pages = a.chunk_tokens // PAGE_SIZE
    while pending or live:
        while pending and len(live) < a.concurrency:
            r = pending[0]
            npages = -(-r["tokens"] // PAGE_SIZE)
            pages, aux = side.alloc(npages)
            if pages is None:
                break
            pending.pop(0)
            s = KVSender(side.mgr, boot, r["room"], **side.sender_args)
            s.init(npages, aux)
            live[r["room"]] = dict(r=r, s=s, pages=pages, aux=aux, t0=time.perf_counter(), sent=False, calls0=list(side.calls),
                                   i=len(plan) - len(pending) - 1)
        for room, st in list(live.items()):
            s = st["s"]
            p = s.poll()
            now = time.perf_counter()
            if not st["sent"] and p == KVPoll.WaitingForInput:
                if held(a, st["i"]):
                    continue
                tf = time.perf_counter()
                side.fill(room, st["pages"])
                st["fill_s"] = time.perf_counter() - tf
                side.metadata.output_ids[st["aux"]][0] = room % 30000
                side.metadata.bootstrap_room[st["aux"]][0] = room
                st["t_send"] = time.perf_counter()
                pages = np.array(st["pages"], dtype=np.int32)
                for i in range(0, len(pages), chunk_pages):
                    s.send(pages[i:i + chunk_pages], None, num_kv_tokens=min(chunk_pages, len(pages) - i) * PAGE_SIZE)
                st["sent"] = True
                if a.abort_room == room:
                    s.abort()
                continue
            if p in (KVPoll.Success, KVPoll.Failed) or now - st["t0"] > deadline_s:
                state = {KVPoll.Success: "success", KVPoll.Failed: "failed"}.get(p, "timeout")
                reason = None
                if p == KVPoll.Failed:
                    try:
                        s.failure_exception()
                    except Exception as e:  # SGLang raises KVTransferError by design
                        reason = str(e)
                c = [x - y for x, y in zip(side.calls, st["calls0"])]
                res.append(dict(room=room, tokens=st["r"]["tokens"], state=state, reason=reason,
                                transfer_s=now - st.get("t_send", now), wall_s=now - st["t0"],
                                engine_calls=c[0], engine_s=c[1], engine_bytes=c[2], engine_ranges=c[3], engine_make_s=c[4], fill_s=st.get("fill_s", 0)))
                side.free(st["pages"], st["aux"])
                del live[room]
                print(json.dumps(dict(progress=len(res), state=state)), flush=True)
        time.sleep(0.0005)


def run_decode(side, plan, a, res):
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    KVReceiver = kv_class(a, "RECEIVER")

    boot = "127.0.0.1:%d" % a.bootstrap_port
    # As the decode scheduler does before it makes receivers for an address.
    end = time.time() + a.request_timeout
    while not side.mgr.try_ensure_parallel_info(boot) and time.time() < end:
        time.sleep(0.2)
    pending = list(plan)
    live = {}
    while pending or live:
        while pending and len(live) < a.concurrency:
            r = pending[0]
            npages = -(-r["tokens"] // PAGE_SIZE)
            pages, aux = side.alloc(npages)
            if pages is None:
                break
            pending.pop(0)
            side.clear(pages)
            t0 = time.perf_counter()
            rcv = KVReceiver(side.mgr, boot, r["room"])
            rcv.init(0)
            live[r["room"]] = dict(r=r, rcv=rcv, pages=pages, aux=aux, t0=t0, meta=False)
        for room, st in list(live.items()):
            rcv = st["rcv"]
            p = rcv.poll()
            now = time.perf_counter()
            if not st["meta"] and p == KVPoll.WaitingForInput:
                rcv.send_metadata(np.array(st["pages"], dtype=np.int32), st["aux"], None)
                st["meta"], st["t_meta"] = True, now
                if a.abort_room == room:
                    rcv.abort()
                continue
            if p in (KVPoll.Success, KVPoll.Failed) or now - st["t0"] > a.request_timeout:
                state = {KVPoll.Success: "success", KVPoll.Failed: "failed"}.get(p, "timeout")
                bad = aux_ok = reason = None
                tc = time.perf_counter()
                if p == KVPoll.Success:
                    bad = side.check(room, st["pages"])
                    aux_ok = int(side.metadata.output_ids[st["aux"]][0]) == room % 30000
                    if bad or not aux_ok:
                        state = "corrupt"
                elif p == KVPoll.Failed:
                    try:
                        rcv.failure_exception()
                    except Exception as e:
                        reason = str(e)
                res.append(dict(room=room, tokens=st["r"]["tokens"], state=state, reason=reason, bad_pages=bad,
                                aux_ok=aux_ok, wall_s=now - st["t0"], after_meta_s=now - st.get("t_meta", now),
                                check_s=time.perf_counter() - tc))
                side.free(st["pages"], st["aux"])
                del live[room]
                print(json.dumps(dict(progress=len(res), state=state)), flush=True)
        time.sleep(0.0005)


def worker(a):
    os.environ["HARNESS_ROLE"] = a.role
    if a.backend == "nixl":
        import nixl._api as engine_module
    else:
        import mooncake.engine as engine_module
    engine_origin = os.path.dirname(engine_module.__file__)
    t0 = time.perf_counter()
    side = Side(a)
    import sglang
    ready = dict(ready=True, role=a.role, sglang=side.version, sglang_module=os.path.dirname(sglang.__file__), engine=engine_origin, setup_s=time.perf_counter() - t0,
                 bytes_per_page=side.bytes_per_page, regions=len(side.kv_args.kv_data_ptrs) + len(side.kv_args.aux_data_ptrs),
                 session_id=side.mgr.get_session_id() if a.backend == "mooncake" else side.mgr.agent.name)
    print(json.dumps(ready), flush=True)
    # The driver sends one command per phase on stdin, so set-up time never
    # counts against a request's timeout and phases share one set-up.
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        with open(cmd["plan"]) as f:
            plan = json.load(f)
        a.abort_room = cmd.get("abort_room", -1)
        a.hold = cmd.get("hold")
        res = []
        t1, notifs0 = time.perf_counter(), side.notifs
        (run_prefill if a.role == "prefill" else run_decode)(side, plan, a, res)
        with open(cmd["out"], "w") as f:
            json.dump(dict(results=res, run_s=time.perf_counter() - t1, notifs=side.notifs - notifs0), f)
        print(json.dumps(dict(done=cmd["out"])), flush=True)
    if hasattr(side.mgr, "deregister_buffer_to_engine"):  # mooncake's; a nixl agent's go with the process
        side.mgr.deregister_buffer_to_engine()
    os._exit(0)  # SGLang's manager threads are not daemonic everywhere


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", required=True, choices=["prefill", "decode"])
    p.add_argument("--backend", choices=["mooncake", "nixl"], default="mooncake")
    p.add_argument("--nixl-host-as-dram", type=int, default=0, help="register the KV pool as DRAM (real NIXL on CPU)")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--dist-port", type=int, required=True)
    p.add_argument("--sglang-bootstrap", type=int, default=1)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--pool-tokens", type=int, default=65536)
    p.add_argument("--aux-slots", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--request-timeout", type=float, default=60)
    p.add_argument("--fill", choices=["full", "sample"], default="full")
    worker(p.parse_args())


if __name__ == "__main__":
    main()
