"""Drives sglang_pd.py: a prefill and a decode process (and their kvproxies),
one scenario, then checks what SGLang's polls ended with and that kvproxy is
back to its baseline. Prints one JSON summary line; exits non-zero on a
failed check.

Scenarios: normal (every request Success, every page right), abort (one
room aborted: it ends Failed on both sides, the rest succeed),
kill-decode (decode engine SIGKILLed mid-run: prefill's rooms all end, the
decode kvproxy drops the dead engine's memory), kill-prefill-kvproxy
(prefill kvproxy SIGKILLed mid-transfer: every room on both sides ends, none
hangs).
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

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_plan(n, lo, hi, seed, sizes=""):
    """n prompt lengths log-uniform in [lo, hi], or sizes "128x20,4096x5" in that order."""
    rng = random.Random(seed)
    if sizes:
        lengths = [int(t) for part in sizes.split(",") for t in [part.split("x")[0]] * int(part.split("x")[1])]
    else:
        lengths = [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]
    return [dict(room=seed * 100000 + i + 1, tokens=t) for i, t in enumerate(lengths)]


class Proc:
    """A child whose stdout lines are collected by a thread."""

    def __init__(self, name, argv, env, stdin=True, log_path=None):
        self.name = name
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        self.lines = []
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
            i = 0
            while True:
                while i < len(self.lines):
                    line = self.lines[i]
                    i += 1
                    if line is None:
                        raise RuntimeError("%s exited (rc=%s) before the expected line" % (self.name, self.p.poll()))
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
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--engine", choices=["mooncake", "kvproxy"], required=True)
    p.add_argument("--mooncake-path", help="folder holding Mooncake's real mooncake package")
    p.add_argument("--kvproxy", help="kvproxy binary")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--ucx-tls", default="")
    p.add_argument("--bootstrap", choices=["sglang", "kvproxy"], default="sglang")
    p.add_argument("--scenario", choices=["normal", "abort", "kill-decode", "kill-prefill-kvproxy"], default="normal")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--sizes", default="", help='fixed plan, e.g. "128x20,32768x3" (overrides --requests)')
    p.add_argument("--fill", choices=["full", "sample"], default="full")
    p.add_argument("--out", help="write the summary JSON here too")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--bound", type=float, default=30, help="a fault's rooms must all end within this many seconds")
    p.add_argument("--workdir")
    p.add_argument("--label", default="")
    a = p.parse_args()

    work = a.workdir or tempfile.mkdtemp(prefix="sglang-pd-")
    os.makedirs(work, exist_ok=True)
    plan = make_plan(a.requests, a.min_tokens, a.max_tokens, a.seed, a.sizes)
    a.requests = len(plan)
    plan_path = os.path.join(work, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    bport = free_port()
    max_tokens = max(r["tokens"] for r in plan)
    pool_tokens = (a.concurrency * (-(-max_tokens // 16)) + 2) * 16
    kvp = {}
    procs = []
    failures = []
    summary = dict(label=a.label, engine=a.engine, transport=a.transport if a.engine == "kvproxy" else "mooncake-tcp",
                   ucx_tls=a.ucx_tls, bootstrap=a.bootstrap, scenario=a.scenario, requests=a.requests, workdir=work)

    def check(ok, what):
        if not ok:
            failures.append(what)

    try:
        env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1", MOONCAKE_PROTOCOL="tcp", MC_FORCE_TCP="1",
                   SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(int(a.bound / 2)),
                   SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(int(a.bound / 2)),
                   SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="1", SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2",
                   PYTHONUNBUFFERED="1")
        if a.engine == "mooncake":
            env["PYTHONPATH"] = a.mooncake_path + os.pathsep + env.get("PYTHONPATH", "")
        else:
            for role in ("prefill", "decode"):
                kvp[role] = KVProxy(a.kvproxy, role, work, a.transport, a.ucx_tls, bport, free_port(), [])
                procs.append(kvp[role])
            summary["baseline"] = {r: gauge(k.metrics(), "kvproxy_registered_regions") for r, k in kvp.items()}
        sides = {}
        for role in ("prefill", "decode"):
            e = dict(env, HARNESS_ROLE=role)
            if role in kvp:
                e["PDROUTER_KVPROXY_SOCK"] = kvp[role].sock
            argv = [a.python, os.path.join(HERE, "sglang_pd.py"), "--role", role, "--plan", plan_path,
                    "--out", os.path.join(work, role + ".json"), "--model-dir", os.path.join(work, "model"),
                    "--bootstrap-port", str(bport), "--dist-port", str(free_port()),
                    "--sglang-bootstrap", "1" if a.bootstrap == "sglang" else "0",
                    "--layers", str(a.layers), "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim),
                    "--pool-tokens", str(pool_tokens), "--concurrency", str(a.concurrency),
                    "--chunk-tokens", str(a.chunk_tokens), "--request-timeout", str(a.bound * 2), "--linger", "1",
                    "--fill", a.fill]
            if a.scenario == "abort":
                argv += ["--abort-room", str(plan[len(plan) // 2]["room"])]
            sides[role] = Proc(role, argv, e, log_path=os.path.join(work, role + ".log"))
            procs.append(sides[role])
            # Prefill first: its bootstrap server must be up before decode asks it.
            sides[role].ready = sides[role].json_line("ready", 180)
        summary["engine_module"] = sides["prefill"].ready["engine"]
        summary["setup_s"] = {r: round(s.ready["setup_s"], 2) for r, s in sides.items()}
        summary["bytes_per_token"] = sides["prefill"].ready["bytes_per_page"] // 16
        if a.engine == "kvproxy":
            summary["registered"] = {r: gauge(k.metrics(), "kvproxy_registered_regions") for r, k in kvp.items()}
        t0 = time.time()
        for s in sides.values():
            s.send("go")
        fault_at = None
        if a.scenario in ("kill-decode", "kill-prefill-kvproxy"):
            # Strike once a few requests are through, so others are mid-transfer.
            time.sleep(1.0)
            fault_at = time.time()
            victim = sides["decode"] if a.scenario == "kill-decode" else kvp["prefill"]
            victim.kill()
            victim.p.wait()
        survivors = [r for r in ("prefill", "decode") if not (a.scenario == "kill-decode" and r == "decode")]
        results = {}
        for role in survivors:
            sides[role].json_line("done", a.bound * 3 + a.requests * 2)
            with open(os.path.join(work, role + ".json")) as f:
                results[role] = json.load(f)
        summary["run_s"] = round(time.time() - t0, 2)
        if fault_at is not None:
            summary["ended_after_fault_s"] = round(time.time() - fault_at, 2)
            check(time.time() - fault_at < a.bound * 3, "rooms ended %.1fs after the fault" % (time.time() - fault_at))
        for role, r in results.items():
            states = {}
            for x in r["results"]:
                states[x["state"]] = states.get(x["state"], 0) + 1
            summary[role + "_states"] = states
            check(len(r["results"]) == a.requests, "%s: %d results for %d requests" % (role, len(r["results"]), a.requests))
            check(states.get("timeout", 0) == 0, "%s: %d rooms never ended (hung)" % (role, states.get("timeout", 0)))
            check(states.get("corrupt", 0) == 0, "%s: %d rooms with wrong bytes" % (role, states.get("corrupt", 0)))
            if a.scenario == "normal":
                check(states.get("success", 0) == a.requests, "%s: not every room succeeded: %s" % (role, states))
            elif a.scenario == "abort":
                aborted = plan[len(plan) // 2]["room"]
                byroom = {x["room"]: x["state"] for x in r["results"]}
                check(byroom.get(aborted) == "failed", "%s: aborted room ended %s" % (role, byroom.get(aborted)))
                check(states.get("success", 0) == a.requests - 1, "%s: the others did not all succeed: %s" % (role, states))
            else:
                check(states.get("failed", 0) > 0, "%s: the fault failed no room: %s" % (role, states))
        if "decode" in results:
            d = [x for x in results["decode"]["results"] if x["state"] == "success"]
            summary["pages_checked"] = sum(-(-x["tokens"] // 16) for x in d)
        if "prefill" in results:
            ok = [x for x in results["prefill"]["results"] if x["state"] == "success"]
            bpt = summary["bytes_per_token"]
            moved = sum(x["tokens"] for x in ok) * bpt
            summary["bytes_moved"] = moved
            summary["per_request"] = [{k: x[k] for k in ("tokens", "transfer_s", "wall_s", "engine_calls", "engine_s", "engine_bytes", "engine_ranges")} for x in ok]
        # Engines exit; kvproxy must drop what they registered.
        for role in survivors:
            sides[role].send("exit")
        for role in survivors:
            sides[role].p.wait(30)
        if a.engine == "kvproxy":
            after = {}
            for role, k in kvp.items():
                if k.p.poll() is not None:
                    continue
                after[role] = wait_gauge(k, "kvproxy_registered_regions", summary["baseline"][role])
                check(after[role] == summary["baseline"][role], "kvproxy %s: %s regions registered after its engine left (baseline %s)" % (role, after[role], summary["baseline"][role]))
            summary["registered_after"] = after
    except Exception as e:
        failures.append("%s: %s" % (type(e).__name__, e))
    finally:
        for pr in procs:
            pr.stop()
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
