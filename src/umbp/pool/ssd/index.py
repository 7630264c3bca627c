"""The SSD tier's key index: which directory a key lives in, where its newest record is, the LRU order,
and the records on disk that are no longer indexed ("ghosts").

Part of SsdTier (umbp.pool.ssd.tier), split out by concern. Ghosts are kept because a restart would find
those records again: a remove() of such a key must still write a tombstone, and a reclaimed segment must
forget them. Callers hold the tier's lock.
"""

from __future__ import annotations

import zlib

from umbp.pool.ssd.format import padded, seal_bytes
from umbp.pool.ssd.shard import _Loc, _Segment, _Shard


class IndexMixin:
    """Part of SsdTier (umbp.pool.ssd.tier), split out by concern: it works on the tier's own state
    (`self`) under the tier's one lock, so the methods read exactly as they would in one class."""

    def _shard_number(self, key: str) -> int:
        """A stable hash (crc32, not Python's salted hash()): the same key maps to the same directory in
        every process and after every restart."""
        return 0 if self._ndirs == 1 else zlib.crc32(key.encode()) % self._ndirs

    def _route(self, key: str) -> _Shard:
        return self._shards[self._shard_number(key)]

    def _index(self, shard: _Shard, key: str, loc: _Loc, nbytes: int = 0) -> None:
        """Index key at loc; nbytes, when known, is its payload's bytes on disk (saves the writer a call a
        record)."""
        shard.index[key] = loc
        self._forget_ghost(shard, key)
        if key not in shard.lru:  # a written put keeps the place it took when it was put
            shard.lru[key] = None
        loc.seg.live[key] = None
        shard.live_bytes += nbytes or padded(loc.length)
        shard.stored_bytes += loc.length

    def _unindex(self, shard: _Shard, key: str, gone: bool) -> _Loc | None:
        """Drop key from the index; gone=True means it left without a remove() (reported by drain_evicted)."""
        loc = shard.index.pop(key, None)
        if loc is None:
            return None
        shard.lru.pop(key, None)
        loc.seg.live.pop(key, None)
        shard.live_bytes -= padded(loc.length)
        shard.stored_bytes -= loc.length
        if gone:
            shard.ghosts[key] = loc.seg  # a restart would find it: a remove() must still write a tombstone
            loc.seg.ghosts[key] = None
            if self._track_evicted:
                self._evicted.append(key)
        return loc

    @staticmethod
    def _forget_ghost(shard: _Shard, key: str) -> bool:
        """Drop key's unindexed record from the ghosts (a newer record or a tombstone shadows it); True if
        there was one."""
        seg = shard.ghosts.pop(key, None)
        if seg is not None:
            seg.ghosts.pop(key, None)
        return seg is not None

    def _set_reserved(self, shard: _Shard, seg: _Segment) -> None:
        new = seg.size if seg.sealed else seg.size + seal_bytes(seg.entry_bytes)
        shard.footprint += new - seg.reserved
        seg.reserved = new
