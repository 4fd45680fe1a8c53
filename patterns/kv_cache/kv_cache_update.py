"""Write this step's keys or values into a static KV cache, in place (``cache.index_copy_(dim, index, value)``)."""
from fusegraph.matching import Input, register_pattern


def _check(m):
    cache, value, index = m.inputs["cache"], m.inputs["value"], m.inputs["index"]
    if cache.shape is None or value.shape is None or len(cache.shape) != len(value.shape):
        return "cache and value ranks differ"
    return True


def _derive(m):
    dim = m.arg("aten.index_copy_.default", 1)
    rank = len(m.inputs["cache"].shape)
    return {"dim": dim % rank}


@register_pattern(
    "fusegraph.kv_cache_update",
    template="kv_cache_update",
    priority=15,
    inputs=[Input("cache", "B KV L D", kind="state"), Input("index", "S", dtype="int64"), Input("value", "B KV S D")],
    dims={"B": (1, 2), "KV": (2, 3), "L": (16, 20), "D": (8, 12), "S": (1, 3)},
    check=_check,
    derive=_derive,
    derived=("dim",),
)
def kv_cache_update(cache, index, value):
    """``cache.index_copy_(2, index, value)``; the output is the updated cache (same storage)."""
    cache.index_copy_(2, index, value)
    return cache
