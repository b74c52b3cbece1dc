"""The main-stream KV caches decoding uses; they live with the patch, which owns the cache
protocol its layers speak (`streamspec.patch.cache`)."""

from ..patch.cache import MainStreamCache, RowCache, StaticCacheView, StaticRowCacheView

__all__ = ["MainStreamCache", "RowCache", "StaticCacheView", "StaticRowCacheView"]
