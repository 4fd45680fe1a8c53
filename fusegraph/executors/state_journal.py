"""Undo a failed step's state writes, so a step that raises leaves the state as eager leaves it.

The fused schedule writes state in a different order than eager does: host ops before the kernel (a cache's
position counter, say) run before the kernel that would, in eager order, have raised first (an out-of-range token
id in the embedding). A kernel that fails part way may also have written KV rows. When a call fails, the executor
rolls the state back to what it was at the start of the call and runs the whole graph eagerly, in program order:
the state afterwards, and the exception if any, are then exactly eager's.

Saving is cheap: an ``index_copy_`` of a KV row saves the rows it is about to overwrite (its index is computed
before the write, by a host op or the caller); a small state tensor (a counter) is saved whole; a large one written
some other way is saved whole too (that write costs as much as the copy).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..program import Program, Ref

_INDEX_COPY = ("aten.index_copy_.default", "aten.index_copy.default")
_COPY = "aten.copy_.default"
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


class StateJournal:
    """What the state tensors of one call held before each write (newest last); :meth:`rollback` restores it."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._whole: set[int] = set()  # ids of tensors saved whole this call (a later save of them is redundant)

    def __len__(self) -> int:
        return len(self._undo)

    def save_node(self, program: Program, node: str, env: dict) -> None:
        """Before ``node`` (an op with ``writes_state``) runs: save the part of its state tensor it will write."""
        d = program.graph.nodes[node]
        state = d.get("writes_state")
        if not state or state not in env:
            return
        target = env[state]
        if not isinstance(target, torch.Tensor) or target.device.type == "meta":
            return
        rows = None
        if d.get("op") in _INDEX_COPY:
            rows = _index_copy_rows(d, env)
            if rows is not None:
                rows = (target, *rows)
        elif d.get("op") == _COPY:
            rows = _copy_of_index_copy(program, d, state, env)
        if rows is None:
            self.save_whole(target)
        else:
            self.save_rows(*rows)

    def save_nodes(self, program: Program, nodes: Iterable[str], env: dict) -> None:
        for n in sorted(nodes, key=lambda n: program.graph.nodes[n]["order"]):
            if program.graph.nodes[n].get("writes_state"):
                self.save_node(program, n, env)

    def save_whole(self, t: torch.Tensor) -> None:
        if id(t) in self._whole:
            return
        self._whole.add(id(t))
        saved = t.detach().clone()
        self._undo.append(lambda: _restore(t, saved))

    def save_rows(self, t: torch.Tensor, dim: int, index: torch.Tensor) -> None:
        if id(t) in self._whole:
            return
        index = index.detach().reshape(-1).to(torch.long).clone()
        size = t.shape[dim]
        index = index[(index >= 0) & (index < size)]  # an out-of-range row is never written (the write raises)
        saved = t.detach().index_select(dim, index).clone()
        self._undo.append(lambda: _restore_rows(t, dim, index, saved))

    def extend(self, other: "StateJournal") -> None:
        """Take ``other``'s saved parts (newer than this journal's) into this one."""
        self._undo += other._undo
        self._whole |= other._whole
        other._undo, other._whole = [], set()

    def rollback(self) -> None:
        """Restore every saved part, newest first (a row written twice gets its value from before the call)."""
        with torch.no_grad():
            while self._undo:
                self._undo.pop()()
        self._whole.clear()


def _index_copy_rows(d: dict, env: dict) -> tuple[int, torch.Tensor] | None:
    """``index_copy_(self, dim, index, source)``: (dim, index) when the index is known before the write."""
    args = d.get("args") or ()
    if len(args) < 3:
        return None
    dim, index = args[1], args[2]
    if isinstance(index, Ref):
        index = env.get(index.node)
    if not isinstance(dim, int) or not isinstance(index, torch.Tensor):
        return None
    return dim, index


def _copy_of_index_copy(program: Program, d: dict, state: str, env: dict
                        ) -> tuple[torch.Tensor, int, torch.Tensor] | None:
    """``copy_(state, view(index_copy(view(state), dim, index, src)))`` (a functionalized in-place write through a
    view, e.g. vLLM's paged ``reshape_and_cache``): (the state viewed as the index_copy sees it, dim, index), so only
    the rows it writes are saved."""
    G = program.graph
    args = d.get("args") or ()
    if len(args) < 2 or not isinstance(args[1], Ref):
        return None
    node = _through_views(G, args[1].node)
    nd = G.nodes[node]
    if nd.get("op") not in _INDEX_COPY or not nd.get("args") or not isinstance(nd["args"][0], Ref):
        return None
    base = nd["args"][0].node
    if _through_views(G, base) != state:
        return None
    rows = _index_copy_rows(nd, env)
    viewed = env[base] if base in env else _view_of(G, base, state, env)
    if rows is None or not isinstance(viewed, torch.Tensor) or viewed.untyped_storage().data_ptr() != \
            env[state].untyped_storage().data_ptr():
        return None
    return (viewed, *rows)


def _view_of(G, node: str, state: str, env: dict) -> torch.Tensor | None:
    """``node`` (a chain of views of ``state`` with constant shapes, not computed yet: inside a kernel) applied to
    the state tensor."""
    if node == state:
        return env[state]
    args = G.nodes[node]["args"]
    inner = _view_of(G, args[0].node, state, env)
    if inner is None or len(args) < 2 or not all(isinstance(x, int) for x in args[1]):
        return None
    try:
        return inner.view(list(args[1]))
    except RuntimeError:
        return None


def _through_views(G, node: str) -> str:
    """The node a chain of view ops starts from."""
    while G.nodes[node].get("op") in _VIEWS and G.nodes[node].get("args") and isinstance(G.nodes[node]["args"][0], Ref):
        node = G.nodes[node]["args"][0].node
    return node


def _restore(t: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.inference_mode(t.is_inference()):  # an inference tensor is written only in inference mode
        t.copy_(saved)


def _restore_rows(t: torch.Tensor, dim: int, index: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.inference_mode(t.is_inference()):
        t.index_copy_(dim, index, saved)
