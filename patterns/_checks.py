"""``check`` functions several built-in patterns share (a plugin package keeps its own helpers the same way)."""


def norm_weight(m):
    """A per-feature norm weight ``[H]`` over the last dim of ``x``."""
    x, w = m.inputs["x"], m.inputs["weight"]
    if w.shape is None or len(w.shape) != 1 or x.shape is None or x.shape[-1] != w.shape[0]:
        return f"weight {w.shape} does not match the normalized dim of x {x.shape}"
    return True


def partial_rotary(m):
    """Partial rotary embedding: an even rotary dim (``cos``'s last dim) smaller than the head size."""
    x, cos = m.inputs["x"], m.inputs["cos"]
    if x.shape is None or cos.shape is None:
        return "unknown shapes"
    R, D = cos.shape[-1], x.shape[-1]
    if not 0 < R < D or R % 2:
        return f"rotary dim {R} must be even and smaller than the head size {D}"
    return True
