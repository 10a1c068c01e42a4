"""nixl._api as SGLang imports it, backed by kvproxy (see pdrouter_kv.agent)."""

from pdrouter_kv.agent import (
    nixl_agent,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

DEFAULT_COMM_PORT = 5555

__all__ = ["DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_prepped_dlist_handle",
           "nixl_thread_sync_t", "nixl_xfer_handle"]
