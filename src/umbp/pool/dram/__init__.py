"""The DRAM tier: `DramPool` and its two halves, `DramIndex` (metadata) and `Arena` (bytes).

    from umbp.pool.dram import DramPool

Modules: `tier` (DramPool and its options), `index` (the slot table: which key holds which pages, LRU,
pins), `arena` (the page-aligned byte region), `allocator` (the page allocator both use). See docs/pool.md.
"""

from umbp.pool.dram.allocator import PageAllocator
from umbp.pool.dram.arena import Arena
from umbp.pool.dram.index import DramIndex, Slot
from umbp.pool.dram.tier import OPTIONS, DramOptions, DramPool

__all__ = ["OPTIONS", "Arena", "DramIndex", "DramOptions", "DramPool", "PageAllocator", "Slot"]
