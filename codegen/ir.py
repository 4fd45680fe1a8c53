"""The kernel IR: semantic instructions over named values, the unit codegen emits and the reference VM runs.

A region of the program (a list of pattern matches) is lowered to a :class:`KernelProgram`: instructions in
execution order, each reading and writing :class:`Value`s. Instructions are dataclasses (HazyResearch
Megakernels style): each carries what its template needs, the program nodes it implements (for comments,
attribution and bisection) and its decoder layer.

Values are per-token feature vectors ``[T, F]`` (T tokens; decode means one position per sequence, so T is the
batch) unless stated otherwise. On chip they live in SBUF as ``[P, FT, T]`` tiles with feature ``f = ft * P + p``
(see :mod:`.layout`). HBM values (weights, caches, step inputs) are kernel arguments.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


class ValueKind:
    ACT = "act"  # per-token activation in SBUF, [P, FT, T]
    WEIGHT = "weight"  # read-only HBM tensor (a model parameter, possibly re-laid out for the kernel)
    STATE = "state"  # HBM tensor written in place (KV cache)
    INPUT = "input"  # per-step HBM input computed outside the kernel (token ids, cos/sin, mask, cache index)
    OUTPUT = "output"  # HBM output of the kernel (logits)
    ROUTING = "routing"  # token-major [T, K] SBUF tile (router top-k weights / expert ids)


@dataclass
class Value:
    name: str  # identifier-safe, unique in the kernel
    kind: str
    shape: tuple[int, ...]  # logical (torch) shape: [T, F] for activations, the tensor shape for HBM values
    dtype: torch.dtype
    node: str | None = None  # program node id it corresponds to (for verification and bisection)
    group: int = 0  # for head-structured activations: the head size (features are [heads, group])

    @property
    def tokens(self) -> int:
        return self.shape[0]

    @property
    def features(self) -> int:
        n = 1
        for s in self.shape[1:]:
            n *= s
        return n


@dataclass
class Instruction:
    """Base class. ``nodes``: program nodes implemented; ``layer``: decoder layer (None outside layers)."""

    opcode: ClassVar[str] = "?"
    nodes: tuple[str, ...] = field(default=(), kw_only=True)
    layer: int | None = field(default=None, kw_only=True)
    module: str | None = field(default=None, kw_only=True)
    pattern: str | None = field(default=None, kw_only=True)

    def reads(self) -> list[Value]:
        return [v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), Value)
                and f.name not in self.output_fields]

    def writes(self) -> list[Value]:
        return [getattr(self, f) for f in self.output_fields if getattr(self, f) is not None]

    output_fields: ClassVar[tuple[str, ...]] = ("out",)


@dataclass
class Load(Instruction):
    """Bring an activation computed outside the kernel (HBM ``[T, F]``) into SBUF."""

    opcode: ClassVar[str] = "load"
    src: Value  # INPUT
    out: Value


@dataclass
class Embed(Instruction):
    opcode: ClassVar[str] = "embed"
    ids: Value  # INPUT [T] int32
    table: Value  # WEIGHT [V, H]
    out: Value
    scale: Value | None = None  # INPUT [1] fp32 (Gemma multiplies embeddings by sqrt(hidden), rounded to the dtype)


@dataclass
class RMSNorm(Instruction):
    """out = w * (x * rsqrt(mean(x^2 over each group) + eps)) (+ offset on w, e.g. Gemma's 1 + w).

    With ``center`` it is LayerNorm: x - mean(x) is normalized, in fp32, then ``* w + bias`` rounded once (what
    ``torch.nn.functional.layer_norm`` does for low-precision inputs). Hidden-state norms only."""

    opcode: ClassVar[str] = "rmsnorm"
    x: Value
    weight: Value | None
    out: Value
    eps: float
    group: int  # normalized group size: F for a hidden-state norm, head_dim for q/k-norm
    weight_offset: float = 0.0
    center: bool = False
    bias: Value | None = None


@dataclass
class Linear(Instruction):
    """out = x @ W.T (+ b), W in HBM already laid out for the kernel (see :mod:`.weights`)."""

    opcode: ClassVar[str] = "linear"
    x: Value
    weight: Value
    out: Value
    bias: Value | None = None


@dataclass
class Rope(Instruction):
    """HF rotate_half RoPE on head-structured x: out = x * cos + rotate_half(x) * sin (cos/sin per token)."""

    opcode: ClassVar[str] = "rope"
    x: Value
    cos: Value  # INPUT [T, D]
    sin: Value  # INPUT [T, D]
    out: Value
    head_dim: int
    rotary_dim: int = 0  # partial rotary: only features [0, rotary_dim) of each head rotate (0: all of them)
    interleaved: bool = False  # rotate pairs (x[2i], x[2i+1]) (GPT-J convention) instead of the two halves


@dataclass
class KVWrite(Instruction):
    """cache[t, head, index[t], :] = value[t, head, :] (in place in HBM)."""

    opcode: ClassVar[str] = "kv_write"
    cache: Value  # STATE [B, Hkv, L, D]
    value: Value  # ACT, head-structured
    index: Value  # INPUT [T] int32 (cache position per sequence)
    output_fields: ClassVar[tuple[str, ...]] = ()


@dataclass
class Attention(Instruction):
    """Grouped-query decode attention over the whole static cache with an additive mask."""

    opcode: ClassVar[str] = "attention"
    q: Value  # ACT [T, Hq * D]
    k_cache: Value  # STATE [B, Hkv, L, D] (already holds this step's rows)
    v_cache: Value
    mask: Value  # INPUT [T, L] fp32 additive
    out: Value  # ACT [T, Hq * D]
    scale: float
    groups: int  # query heads per kv head
    rounding: str = "eager"  # "eager": scores rounded to q's dtype after each op, like HF eager; "fused": fp32 (SDPA)
    softcap: float = 0.0  # Gemma 2: scores -> tanh(scores / softcap) * softcap before the mask (0: off)


@dataclass
class Add(Instruction):
    opcode: ClassVar[str] = "add"
    a: Value
    b: Value
    out: Value


@dataclass
class GatedAct(Instruction):
    """out = act(gate) * up (SwiGLU and friends)."""

    opcode: ClassVar[str] = "gated_act"
    gate: Value
    up: Value
    out: Value
    act: str = "silu"


@dataclass
class ScalarGate(Instruction):
    """out = sigmoid(gate) * x with one gate logit per token (a shared expert's gate)."""

    opcode: ClassVar[str] = "sigmoid_gate"
    gate: Value  # ACT [T, 1]
    x: Value
    out: Value


@dataclass
class Router(Instruction):
    """Softmax over experts (fp32), top-k, optional renormalization; routing weights cast to ``weights.dtype``.

    The k experts are distinct; among equal probabilities the lower expert index comes first (what
    ``jax.lax.top_k`` documents; torch.topk leaves it to the implementation)."""

    opcode: ClassVar[str] = "router"
    x: Value
    weight: Value  # WEIGHT laid out [P, KT, E]
    weights: Value  # ROUTING [T, K]
    indices: Value  # ROUTING [T, K] int32
    top_k: int
    normalize: bool
    #: the kernel's router-tie flag [T, 1] fp32 (ROUTING), shared by every router of the kernel: set to 1 for a
    #: token whose k-th and (k+1)-th probabilities are equal (torch.topk's choice between them is
    #: implementation-defined, so the executor recomputes such a step eagerly); the first router initializes it
    tie: Value | None = None
    tie_first: bool = False
    output_fields: ClassVar[tuple[str, ...]] = ("weights", "indices", "tie")


@dataclass
class Experts(Instruction):
    """out = sum_k w[t,k] * down[e](act(gate[e] x_t) * up[e] x_t), e = idx[t,k]; only chosen experts are read."""

    opcode: ClassVar[str] = "experts"
    x: Value
    weights: Value
    indices: Value
    gate_up: Value  # WEIGHT [E, ...] laid out per expert
    down: Value
    out: Value
    intermediate: int
    act: str = "silu"


@dataclass
class Elementwise(Instruction):
    """A generically lowered piece: ``ops`` (see :mod:`.generic`) over ``inputs``, producing ``outputs``.

    Local names in ``ops`` are program node ids; ``input_names``/``output_names`` tie them to kernel values.
    Input classes: ``full`` (activation), ``token`` (per-token scalar activation), ``feature`` (a weight vector).
    """

    opcode: ClassVar[str] = "generic"
    inputs: tuple[Value, ...]
    input_names: tuple[str, ...]
    input_classes: tuple[str, ...]
    ops: tuple[Any, ...]
    outputs: tuple[Value, ...]
    output_names: tuple[str, ...]
    output_fields: ClassVar[tuple[str, ...]] = ()

    def reads(self) -> list[Value]:
        return list(self.inputs)

    def writes(self) -> list[Value]:
        return list(self.outputs)


@dataclass
class Store(Instruction):
    """Write an SBUF activation to an HBM output tensor [T, F] (kernel outputs are in shared HBM)."""

    opcode: ClassVar[str] = "store"
    x: Value
    dst: Value  # OUTPUT
    output_fields: ClassVar[tuple[str, ...]] = ()


@dataclass
class Guard(Instruction):
    """Store a guard flag ([T, 1] fp32, 0 or 1, token-major) to an HBM output. A set flag tells the executor that
    the kernel's result for this step may differ from eager for a reason the kernel can detect but not resolve
    (``reason``), so the step is recomputed on the eager path."""

    opcode: ClassVar[str] = "guard"
    x: Value  # ROUTING [T, 1]
    dst: Value  # OUTPUT [T, 1]
    reason: str = ""
    output_fields: ClassVar[tuple[str, ...]] = ()


@dataclass
class KernelProgram:
    """What one megakernel computes: instructions in order plus its HBM interface."""

    name: str
    tokens: int
    instructions: list[Instruction]
    inputs: list[Value]  # HBM arguments in signature order (inputs, weights, state)
    outputs: list[Value]  # returned HBM tensors (outputs first, then state returned for in-place writes)
    meta: dict[str, Any] = field(default_factory=dict)

    def layers(self) -> list[int]:
        return sorted({i.layer for i in self.instructions if i.layer is not None})
