"""Keep the garbage collector off what a server builds at start-up."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then move every object still alive into the collector's permanent generation;
    return how many objects were frozen. Call once, when start-up is done, before serving.

    What a server builds at start-up (modules, the tokenizer, the plugin pipeline, the web app)
    lives as long as the process, yet every full collection walks all of it: the EPP's ~110k
    start-up objects take ~100 ms a collection on a 2-core VM, with the event loop stalled and
    every request in flight waiting. Frozen, a full collection walks only what came after.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
