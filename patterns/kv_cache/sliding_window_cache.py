"""A full sliding-window KV cache (transformers 5.24 ``StaticSlidingWindowLayer`` once full): one new row per step.

The layer keeps the window's last ``W`` positions in order (slot ``j`` holds position ``p - W + 1 + j`` after
the step). Once it is full, a one-token update rolls the window left by one and writes the new row into the
last slot::

    new_keys = self.keys.roll(-1, dims=-2)
    new_keys[:, :, torch.tensor([-1])] = key_states
    self.keys.copy_(new_keys)

(its mask covers the same ``W`` positions, ``kv_offset = p - W + 1``). Before the window is full the layer
writes with ``index_copy_`` at its length counter: :mod:`.kv_cache_update`.
"""
from fusegraph.matching import Input, register_pattern


def _check(m):
    cache, value, index = m.inputs["cache"], m.inputs["value"], m.inputs["index"]
    if cache.shape is None or value.shape is None or len(cache.shape) != 4 or len(value.shape) != 4:
        return "the sliding-window roll needs [B, KV, W, D] caches"
    if value.shape[2] != 1:
        return f"{value.shape[2]} new rows: only one-token decode steps roll the window"
    return True


@register_pattern(
    "fusegraph.sliding_window_roll",
    template="sliding_window_roll",
    priority=16,
    inputs=[Input("cache", "B KV W D", kind="state"), Input("index", "1", dtype="int64"), Input("value", "B KV 1 D")],
    dims={"B": (2, 3), "KV": (2, 3), "W": (16, 20), "D": (8, 12)},
    cases=[{"B": 1}, {}],
    check=_check,
)
def sliding_window_roll(cache, index, value):
    """``cache`` rolled left by one position along dim 2, ``value`` written at ``index`` (HF: ``[-1]``, the last
    slot), copied back in place; the output is the updated cache (same storage)."""
    new = cache.roll(-1, dims=-2)
    new[:, :, index] = value
    cache.copy_(new)
    return cache
