"""mooncake.engine as SGLang imports it, backed by kvproxy (see pdrouter_kv.engine)."""

from pdrouter_kv.engine import TransferEngine

__all__ = ["TransferEngine"]
