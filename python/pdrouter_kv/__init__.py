"""pdrouter's Python side of kvproxy: the control client and a Mooncake-compatible TransferEngine."""
