"""Drives sglang_pd.py: a prefill and a decode process (and their kvproxies),
one scenario, then checks what SGLang's polls ended with and that kvproxy is
back to its baseline. Prints one JSON summary line; exits non-zero on a
failed check.

Scenarios: normal (every request Success, every page right), abort (one
room aborted: it ends Failed on both sides, the rest succeed),
kill-decode (decode engine SIGKILLed mid-run: prefill's rooms all end, the
decode kvproxy drops the dead engine's memory), kill-prefill-kvproxy and
kill-decode-kvproxy (that kvproxy SIGKILLed mid-transfer: every room on both
sides ends, none hangs; restarted, the running engine registers its memory
again).
"""

import argparse
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import children
import sglang_versions

HERE = os.path.dirname(os.path.abspath(__file__))


_handed_out = set()


def free_port():
    """A free port below the kernel's ephemeral range, not handed out before.

    A port from bind(0) is an ephemeral one, and another bind(0) (SGLang's
    engines bind several servers that way) could take it before the engine
    that was given it binds it: the prefill's bootstrap server then failed
    with "address already in use" and the run hung. No bind(0) takes a port
    below the range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    low = max(1024, ephemeral - 12000)
    for _ in range(1000):
        port = random.randrange(low, ephemeral)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port in [%d, %d)" % (low, ephemeral))


def make_plan(n, lo, hi, seed, sizes=""):
    """n prompt lengths log-uniform in [lo, hi], or sizes "128x20,4096x5" in that order."""
    rng = random.Random(seed)
    if sizes:
        lengths = [int(t) for part in sizes.split(",") for t in [part.split("x")[0]] * int(part.split("x")[1])]
    else:
        lengths = [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]
    return [dict(room=seed * 100000 + i + 1, tokens=t) for i, t in enumerate(lengths)]


class Proc:
    """A child whose stdout lines are collected by a thread; it ends with the
    harness (children.py). Start one from the main thread."""

    def __init__(self, name, argv, env, stdin=True, log_path=None):
        self.name = name
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.p = children.spawn(argv, env=env, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines = []
        self.pos = 0  # lines before pos were consumed by an earlier wait
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()
        with self.cv:
            self.lines.append(None)
            self.cv.notify_all()

    def wait_line(self, pred, timeout):
        end = time.time() + timeout
        with self.cv:
            while True:
                while self.pos < len(self.lines):
                    line = self.lines[self.pos]
                    if line is None:
                        raise RuntimeError("%s exited (rc=%s) before the expected line" % (self.name, self.p.poll()))
                    self.pos += 1
                    if pred(line):
                        return line
                left = end - time.time()
                if left <= 0:
                    raise TimeoutError("%s: no expected line within %ss" % (self.name, timeout))
                self.cv.wait(left)

    def json_line(self, key, timeout):
        line = self.wait_line(lambda l: l.startswith("{") and key in json.loads(l), timeout)
        return json.loads(line)

    def send(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def kill(self, sig=signal.SIGKILL):
        if self.p.poll() is None:
            self.p.send_signal(sig)

    def stop(self, timeout=10):
        children.stop(self.p, timeout)


class KVProxy(Proc):
    def __init__(self, binary, role, workdir, transport, ucx_tls, bootstrap_port, peer_port, extra):
        self.sock = os.path.join(workdir, "kvproxy-%s.sock" % role)
        argv = [binary, "--role", role, "--transport", transport, "--control", self.sock,
                "--host", "127.0.0.1", "--peer-port", str(peer_port), "--metrics-port", "0",
                "--log-level", "warn"] + extra
        if role == "prefill":
            argv += ["--bootstrap-port", str(bootstrap_port)]
        env = dict(os.environ)
        if ucx_tls:
            env["UCX_TLS"] = ucx_tls
        self.argv, self.env, self.role, self.workdir = argv, env, role, workdir
        super().__init__("kvproxy-" + role, argv, env, stdin=False, log_path=os.path.join(workdir, "kvproxy-%s.log" % role))
        line = self.wait_line(lambda l: l.startswith("kvproxy ready"), 20)
        self.fields = dict(kv.split("=", 1) for kv in line.split()[2:])

    def restart(self):
        """Starts the same kvproxy again (same control socket and ports)."""
        Proc.__init__(self, "kvproxy-" + self.role, self.argv, self.env, stdin=False,
                      log_path=os.path.join(self.workdir, "kvproxy-%s.log.%d" % (self.role, int(time.time()))))
        line = self.wait_line(lambda l: l.startswith("kvproxy ready"), 20)
        self.fields = dict(kv.split("=", 1) for kv in line.split()[2:])

    def metrics(self):
        url = "http://%s/metrics" % self.fields["metrics"]
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(kvproxy_[a-z_]+)(\{[^}]*\})?\s+([0-9.e+-]+)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out


def gauge(metrics, name):
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def wait_gauge(kp, name, want, timeout=10):
    end = time.time() + timeout
    got = None
    while time.time() < end:
        got = gauge(kp.metrics(), name)
        if got == want:
            return got
        time.sleep(0.1)
    return got


def counts(results):
    states = {}
    for x in results:
        states[x["state"]] = states.get(x["state"], 0) + 1
    return states


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--engine", choices=["mooncake", "kvproxy", "nixl", "nixl-real"], required=True,
                   help="mooncake: SGLang's mooncake backend on Mooncake's engine; kvproxy: the same on python/mooncake; "
                        "nixl: SGLang's nixl backend on python/nixl (kvproxy); nixl-real: the same on NIXL from PyPI")
    p.add_argument("--mooncake-path", help="folder holding Mooncake's real mooncake package")
    p.add_argument("--nixl-path", help="folder holding NIXL's real nixl package (for --engine nixl-real)")
    p.add_argument("--sglang-path", help="folder holding another SGLang (e.g. 0.5.20), put before the venv's")
    p.add_argument("--kvproxy", help="kvproxy binary")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--ucx-tls", default="")
    p.add_argument("--kvproxy-arg", action="append", default=[], help="extra kvproxy flag (repeatable)")
    p.add_argument("--bootstrap", choices=["sglang", "kvproxy"], default="sglang")
    p.add_argument("--phases", default="normal",
                   help="comma list of warmup, normal, kill-prefill-kvproxy / kill-decode-kvproxy (then restarts it), recover, kill-decode (last)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--sizes", default="", help='normal phase plan, e.g. "128x20,32768x3" (overrides --requests)')
    # Few enough that all are in flight when the fault strikes: a room whose
    # peer is gone before it starts only waits out SGLang's bootstrap timeout.
    p.add_argument("--fault-requests", type=int, default=6)
    p.add_argument("--fault-tokens", type=int, default=8192)
    p.add_argument("--fault-after", type=int, default=2, help="strike a fault phase once prefill finished this many rooms")
    p.add_argument("--abort", type=int, default=1, help="abort one room of the normal phase")
    p.add_argument("--fill", choices=["full", "sample"], default="full")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--bound", type=float, default=20, help="a fault's rooms must all end within this many seconds")
    p.add_argument("--workdir")
    p.add_argument("--label", default="")
    p.add_argument("--out", help="write the summary JSON (with per-request figures) here")
    a = p.parse_args()
    children.exit_on_signals()

    work = a.workdir or tempfile.mkdtemp(prefix="sglang-pd-")
    os.makedirs(work, exist_ok=True)
    phases = a.phases.split(",")
    plans = {}
    seed = 1
    for ph in phases:
        if ph == "normal":
            plans[ph] = make_plan(a.requests, a.min_tokens, a.max_tokens, seed, a.sizes)
        elif ph == "warmup":
            # One request as large as the largest of the run: with SGLang's
            # rotating free list it touches every page kvproxy maps once.
            biggest = max(r["tokens"] for r in make_plan(a.requests, a.min_tokens, a.max_tokens, seed, a.sizes))
            plans[ph] = make_plan(1, 0, 0, 99, "%dx1" % biggest)
        elif ph == "recover":
            plans[ph] = make_plan(20, a.min_tokens, a.max_tokens, seed)
        else:
            plans[ph] = make_plan(a.fault_requests, 0, 0, seed, "%dx%d" % (a.fault_tokens, a.fault_requests))
        seed += 1
    bport = free_port()
    max_tokens = max(r["tokens"] for pl in plans.values() for r in pl)
    pool_tokens = (a.concurrency * (-(-max_tokens // 16)) + 2) * 16
    kvp, sides, procs, failures = {}, {}, [], []
    over_kvproxy = a.engine in ("kvproxy", "nixl")
    backend = "nixl" if a.engine.startswith("nixl") else "mooncake"
    transport = a.transport if over_kvproxy else {"mooncake": "mooncake-tcp", "nixl-real": "nixl-ucx"}[a.engine]
    summary = dict(label=a.label, engine=a.engine, backend=backend, transport=transport,
                   ucx_tls=a.ucx_tls, bootstrap=a.bootstrap, phases={}, workdir=work)

    def check(ok, what):
        if not ok:
            failures.append(what)

    def regions(role):
        return gauge(kvp[role].metrics(), "kvproxy_registered_regions")

    try:
        env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1", MOONCAKE_PROTOCOL="tcp", MC_FORCE_TCP="1",
                   SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(int(a.bound / 2)),
                   SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(int(a.bound / 2)),
                   SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="1", SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2",
                   SGLANG_ENABLE_FAILED_SESSION_PROBE="1", SGLANG_FAILED_SESSION_PROBE_INTERVAL_S="0.5",
                   SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S="1", PYTHONUNBUFFERED="1")
        # This tree's python/ before the venv's installed copy: several trees
        # share one cached venv, and another's install must not change the run.
        env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
        if a.sglang_path:
            env["PYTHONPATH"] = a.sglang_path + os.pathsep + env["PYTHONPATH"]
        if a.engine == "mooncake":
            env["PYTHONPATH"] = a.mooncake_path + os.pathsep + env.get("PYTHONPATH", "")
        elif a.engine == "nixl-real":
            env["PYTHONPATH"] = a.nixl_path + os.pathsep + env.get("PYTHONPATH", "")
            if a.ucx_tls:
                env["UCX_TLS"] = a.ucx_tls
        else:
            for role in ("prefill", "decode"):
                # A fixed peer port: a restarted kvproxy keeps the session id SGLang holds.
                # With SGLang's bootstrap server, kvproxy's own stays off its port.
                kvp[role] = KVProxy(a.kvproxy, role, work, a.transport, a.ucx_tls,
                                    bport if a.bootstrap == "kvproxy" else free_port(), free_port(), a.kvproxy_arg)
                procs.append(kvp[role])
            summary["baseline_regions"] = {r: regions(r) for r in kvp}
        for role in ("prefill", "decode"):
            e = dict(env, HARNESS_ROLE=role)
            if role in kvp:
                e["PDROUTER_KVPROXY_SOCK"] = kvp[role].sock
            argv = [a.python, os.path.join(HERE, "sglang_pd.py"), "--role", role, "--backend", backend,
                    "--nixl-host-as-dram", "1" if a.engine == "nixl-real" else "0",
                    "--model-dir", os.path.join(work, "model-" + role),
                    "--bootstrap-port", str(bport), "--dist-port", str(free_port()),
                    "--sglang-bootstrap", "1" if a.bootstrap == "sglang" else "0",
                    "--layers", str(a.layers), "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim),
                    "--pool-tokens", str(pool_tokens), "--concurrency", str(a.concurrency),
                    "--chunk-tokens", str(a.chunk_tokens), "--request-timeout", str(a.bound * 2), "--fill", a.fill]
            sides[role] = Proc(role, argv, e, log_path=os.path.join(work, role + ".log"))
            procs.append(sides[role])
        for role, s in sides.items():  # both set up at once
            s.ready = s.json_line("ready", 300)
        summary["engine_module"] = sides["prefill"].ready["engine"]
        summary["sglang"] = sides["prefill"].ready["sglang"]
        if a.sglang_path:
            check(all(os.path.realpath(s.ready["sglang_module"]).startswith(os.path.realpath(a.sglang_path) + os.sep) for s in sides.values()),
                  "SGLang came from %s, not --sglang-path" % sides["prefill"].ready["sglang_module"])
        summary["setup_s"] = {r: round(s.ready["setup_s"], 2) for r, s in sides.items()}
        summary["bytes_per_token"] = sides["prefill"].ready["bytes_per_page"] // 16
        if kvp:
            summary["registered_regions"] = {r: regions(r) for r in kvp}
            check(all(v > 0 for v in summary["registered_regions"].values()), "engines registered nothing with kvproxy")

        alive = ["prefill", "decode"]
        for ph in phases:
            plan = plans[ph]
            plan_path = os.path.join(work, ph + "-plan.json")
            with open(plan_path, "w") as f:
                json.dump(plan, f)
            aborted = plan[len(plan) // 2]["room"] if ph == "normal" and a.abort and len(plan) > 1 else -1
            t0 = time.time()
            faulty = ph in ("kill-decode", "kill-prefill-kvproxy", "kill-decode-kvproxy")
            struck = os.path.join(work, "%s.struck" % ph)
            hold = dict(after=a.fault_after, until=struck) if faulty else None
            for role in alive:
                sides[role].send(json.dumps(dict(cmd="run", plan=plan_path, out=os.path.join(work, "%s-%s.json" % (ph, role)),
                                                 abort_room=aborted, hold=hold)))
            fault_at = None
            if faulty:
                # Strike with rooms done and rooms still moving.
                sides["prefill"].wait_line(lambda l: '"progress": %d,' % a.fault_after in l, a.bound * 2)
                fault_at = time.time()
                victim = sides["decode"] if ph == "kill-decode" else kvp[ph.split("-")[1]]
                victim.kill()
                victim.p.wait()
                open(struck, "w").close()
                if ph == "kill-decode":
                    alive = ["prefill"]
            res, notifs = {}, {}
            for role in alive:
                sides[role].json_line("done", a.bound * 3 + len(plan) * 2)
                with open(os.path.join(work, "%s-%s.json" % (ph, role))) as f:
                    out = json.load(f)
                res[role], notifs[role] = out["results"], out.get("notifs", 0)
            ps = dict(requests=len(plan), run_s=round(time.time() - t0, 2))
            if backend == "nixl" and "decode" in res:
                # A room's KV and aux each end in a notification where the version completes by them.
                ps["notifs"] = notifs["decode"]
                landed = sum(1 for x in res["decode"] if x["state"] == "success")
                if sglang_versions.VERSIONS[summary["sglang"]].by_notifs:
                    check(ps["notifs"] >= 2 * landed, "%s: %d notifications for %d rooms landed" % (ph, ps["notifs"], landed))
            if fault_at is not None:
                ps["ended_after_fault_s"] = round(time.time() - fault_at, 2)
                # Every room a fault failed ended within the bound (SGLang's
                # timeouts are set to half of it), none hung.
                slowest = max([x["wall_s"] for r in res.values() for x in r if x["state"] == "failed"] or [0])
                ps["slowest_failed_room_s"] = round(slowest, 2)
                check(slowest <= a.bound, "%s: a failed room took %.1fs to end" % (ph, slowest))
            for role, r in res.items():
                st = counts(r)
                ps[role] = st
                check(len(r) == len(plan), "%s %s: %d results for %d requests" % (ph, role, len(r), len(plan)))
                check(st.get("timeout", 0) == 0, "%s %s: %d rooms never ended (hung)" % (ph, role, st.get("timeout", 0)))
                check(st.get("corrupt", 0) == 0, "%s %s: %d rooms with wrong bytes" % (ph, role, st.get("corrupt", 0)))
                if ph in ("normal", "recover", "warmup"):
                    want = len(plan) - (1 if aborted >= 0 else 0)
                    check(st.get("success", 0) == want, "%s %s: %d of %d rooms succeeded: %s" % (ph, role, st.get("success", 0), want, st))
                    if aborted >= 0:
                        got = [x["state"] for x in r if x["room"] == aborted]
                        check(got == ["failed"], "%s %s: the aborted room ended %s" % (ph, role, got))
                else:
                    check(st.get("failed", 0) > 0, "%s %s: the fault failed no room: %s" % (ph, role, st))
            if "decode" in res:
                ps["pages_checked"] = sum(-(-x["tokens"] // 16) for x in res["decode"] if x["state"] == "success")
            if ph == "normal" and "prefill" in res:
                ok = [x for x in res["prefill"] if x["state"] == "success"]
                ps["bytes_moved"] = sum(x["tokens"] for x in ok) * summary["bytes_per_token"]
                summary["per_request"] = [{k: x[k] for k in ("tokens", "transfer_s", "wall_s", "engine_calls", "engine_s", "engine_bytes", "engine_ranges", "engine_make_s", "fill_s")} for x in ok]
                dec = {x["room"]: x for x in res.get("decode", [])}
                for pr, x in zip(summary["per_request"], ok):
                    d = dec.get(x["room"])
                    pr["decode_wall_s"] = d["wall_s"] if d else None
                    pr["check_s"] = d["check_s"] if d else None
            if ph in ("kill-prefill-kvproxy", "kill-decode-kvproxy"):
                role = ph.split("-")[1]
                kvp[role].restart()
                # The engine's watcher reconnects and registers again (a
                # decode engine makes no call that would); SGLang's
                # failed-session probe then lifts its blacklist of the session.
                t_restart = time.time()
                got = wait_gauge(kvp[role], "kvproxy_registered_regions", summary["registered_regions"][role], a.bound)
                ps["%s_regions_after_restart" % role] = got
                ps["registered_again_s"] = round(time.time() - t_restart, 2)
                check(got == summary["registered_regions"][role], "the %s engine did not register again with its restarted kvproxy (%s regions)" % (role, got))
                time.sleep(2)
            if ph == "kill-decode" and kvp:
                got = wait_gauge(kvp["decode"], "kvproxy_registered_regions", summary["baseline_regions"]["decode"], a.bound)
                ps["decode_kvproxy_regions_after"] = got
                check(got == summary["baseline_regions"]["decode"], "kill-decode: decode kvproxy still holds %s regions of the dead engine" % got)
            summary["phases"][ph] = ps
        for role in alive:
            sides[role].send(json.dumps(dict(cmd="exit")))
        for role in alive:
            sides[role].p.wait(30)
        if kvp:
            after = {}
            for role, k in kvp.items():
                after[role] = wait_gauge(k, "kvproxy_registered_regions", summary["baseline_regions"][role])
                check(after[role] == summary["baseline_regions"][role], "kvproxy %s: %s regions registered after its engine left (baseline %s)" % (role, after[role], summary["baseline_regions"][role]))
            summary["regions_after_exit"] = after
    except Exception as e:
        failures.append("%s: %s" % (type(e).__name__, e))
    finally:
        for pr in procs:
            pr.stop()
        children.stop_all()  # one started but not yet in procs
    summary["failures"] = failures
    summary["ok"] = not failures
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f)
    summary.pop("per_request", None)
    print(json.dumps(summary), flush=True)
    sys.exit(0 if not failures else 1)


if __name__ == "__main__":
    main()
