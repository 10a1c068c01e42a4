"""run_pd.py's ports come from below the kernel's ephemeral range, so that no
bind(0) of an engine's own servers can take one before the engine it was
given to binds it (a prefill's bootstrap port was lost that way and the run
hung), and no port is handed out twice.

Run from python/harness: python3 -m unittest test_ports
"""

import socket
import unittest

import run_pd


def ephemeral_low():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


class FreePortTest(unittest.TestCase):
    def test_below_the_ephemeral_range_distinct_and_bindable(self):
        low = ephemeral_low()
        ports = [run_pd.free_port() for _ in range(200)]
        self.assertEqual(len(set(ports)), len(ports), "a port handed out twice")
        for p in ports:
            self.assertTrue(1024 <= p < low, "port %d is not below the ephemeral range (%d)" % (p, low))
        with socket.socket() as s:
            s.bind(("127.0.0.1", ports[-1]))

    def test_skips_a_port_in_use_and_one_handed_out(self):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        given = run_pd.free_port()
        free = run_pd.free_port()
        draws = iter([busy, given, free])
        real = run_pd.random.randrange
        run_pd.random.randrange = lambda lo, hi: next(draws)
        try:
            run_pd._handed_out.discard(free)
            self.assertEqual(run_pd.free_port(), free)
        finally:
            run_pd.random.randrange = real
            held.close()


if __name__ == "__main__":
    unittest.main()
