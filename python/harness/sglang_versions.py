"""What sglang_pd.py does differently per SGLang version, in one table.

0.5.23 is the venv's; 0.5.20 (the last whose nixl backend completes by NIXL
notifications) runs from a folder of its own put first on sys.path
(scripts/sglang-venv.sh). Between them the scheduler's parallel set-up and
the KVSender's arguments changed; the pools, KVArgs and receivers did not.
"""

import collections


def _runtime_0523(sa, dist_port):
    from sglang.srt.distributed.bootstrap import init_parallel_runtime
    from sglang.srt.runtime_context import SpawnRanks, publish

    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    init_parallel_runtime(server_args=sa, device="cpu", dist_port=dist_port)
    return {}


def _runtime_0520(sa, dist_port):
    # The scheduler publishes, then its model runner builds the groups from
    # the ParallelState the scheduler made (and hands the KV manager).
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.runtime_context import publish

    publish(sa, role="scheduler")
    ps = ParallelState.trivial(dp_rank=None)
    bootstrap.init_torch_distributed(server_args=sa, model_config=ModelConfig.from_server_args(sa), device="cpu",
                                     ps=ps, dist_port=dist_port, is_draft_worker=False, local_omp_cpuid=None)
    return {"ps": ps}


class Version(collections.namedtuple("Version", "runtime sender_args by_notifs")):
    """runtime(server_args, dist_port) sets up the process as the scheduler
    does and returns attributes the KV manager reads off the scheduler;
    sender_args follow KVSender's (mgr, bootstrap_addr, room); by_notifs: the
    nixl backend learns a room landed from NIXL notifications, not ZMQ."""


VERSIONS = {
    "0.5.23": Version(_runtime_0523, {}, False),
    "0.5.20": Version(_runtime_0520, {"dest_tp_ranks": [0], "pp_rank": 0}, True),
}


def current():
    """(version, its row) of the SGLang first on sys.path, which must be in the table."""
    import sglang

    v = sglang.__version__
    if v not in VERSIONS:
        raise SystemExit("sglang %s: the harness knows %s (python/harness/sglang_versions.py)" % (v, sorted(VERSIONS)))
    return v, VERSIONS[v]
