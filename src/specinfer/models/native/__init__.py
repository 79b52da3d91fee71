"""Native model runtime: Llama-family and OPT blocks, KV pool, fused tree attention."""

from specinfer.models.native.backend import NativeBackend, NativeOptions
from specinfer.models.native.kv_pool import KVCacheFull
from specinfer.models.native.spec import ModelSpec, UnsupportedModel

__all__ = ["KVCacheFull", "ModelSpec", "NativeBackend", "NativeOptions", "UnsupportedModel"]
