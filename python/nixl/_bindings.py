"""The error classes of nixl._bindings that callers catch (see pdrouter_kv.agent)."""

from pdrouter_kv.agent import (
    nixlBackendError,
    nixlCancelledError,
    nixlError,
    nixlInvalidParamError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
)

__all__ = ["nixlBackendError", "nixlCancelledError", "nixlError", "nixlInvalidParamError", "nixlNotFoundError",
           "nixlNotPostedError", "nixlNotSupportedError", "nixlRemoteDisconnectError", "nixlRepostActiveError"]
