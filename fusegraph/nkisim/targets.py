"""Hardware targets (trn2 = NeuronCore-v3, trn3 = NeuronCore-v4) and their documented limits.

Selection mirrors the official ``NEURON_PLATFORM_TARGET_OVERRIDE`` (``trn2|gen3``, ``trn3|gen4``; unset: trn3, as
``nki.simulate`` on a host without a Neuron chip); trn1/inf2 (NeuronCore-v2) are rejected because fusegraph does
not target them.  Numbers come from the architecture guides of SDK 2.29 (see shared/reference/nki_api.md §3).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .enums import nc_version

KIB = 1024


@dataclass(frozen=True)
class Target:
    name: str
    nc_version: nc_version
    sbuf_bytes_per_partition: int  # physical
    sbuf_reserved_bytes: int  # default reserve subtracted for the usable budget (see default_sbuf_budget)
    psum_banks: int = 8
    psum_bank_bytes: int = 2 * KIB
    partitions: int = 128
    matmul_moving_fmax_fp32: int = 512
    matmul_moving_fmax_bf16: int = 512
    matmul_dst_dtypes: tuple[str, ...] = ("float32",)
    matmul_input_dtypes: tuple[str, ...] = ("float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32")
    psum_tensor_may_span_banks: bool = False
    supports_exponential: bool = False
    psum_accumulate_after_non_matmul_write: bool = False

    @property
    def psum_bytes_per_partition(self) -> int:
        return self.psum_banks * self.psum_bank_bytes

    @property
    def default_sbuf_budget(self) -> int:
        """Usable SBUF bytes per partition by default: physical minus a 16 KiB reserve.

        The official ``tile_size.total_available_sbuf_size`` is "total minus reserved bytes" but its value is not
        published; nki-library's tests budget ``total_available_sbuf_size - 16 KiB``.  We are conservative and
        reserve 16 KiB of the physical partition; override with ``FUSEGRAPH_SBUF_BUDGET`` or ``sbuf_budget=``."""
        return self.sbuf_bytes_per_partition - self.sbuf_reserved_bytes


TRN2 = Target(
    name="trn2",
    nc_version=nc_version.gen3,
    sbuf_bytes_per_partition=224 * KIB,
    sbuf_reserved_bytes=16 * KIB,
)

TRN3 = Target(
    name="trn3",
    nc_version=nc_version.gen4,
    sbuf_bytes_per_partition=256 * KIB,
    sbuf_reserved_bytes=16 * KIB,
    matmul_moving_fmax_fp32=4096,
    matmul_moving_fmax_bf16=8192,
    matmul_dst_dtypes=("float32", "bfloat16"),
    matmul_input_dtypes=(
        "float8_e4m3",
        "float8_e5m2",
        "float8_e4m3fn",
        "bfloat16",
        "float16",
        "tfloat32",
        "float32",
    ),
    psum_tensor_may_span_banks=True,
    supports_exponential=True,
    psum_accumulate_after_non_matmul_write=True,
)

_ALIASES = {"trn2": TRN2, "gen3": TRN2, "trn3": TRN3, "gen4": TRN3}
_UNSUPPORTED = {"trn1", "inf2", "gen2"}

ENV_TARGET = "NEURON_PLATFORM_TARGET_OVERRIDE"
ENV_SBUF_BUDGET = "FUSEGRAPH_SBUF_BUDGET"


#: the target when none is given and ``NEURON_PLATFORM_TARGET_OVERRIDE`` is unset: ``nki.simulate`` uses the
#: detected Neuron chip, "otherwise defaults to trn3" (nki_simulator.rst, SDK 2.29); this host has no chip.
DEFAULT_TARGET = "trn3"


def get_target(name: str | Target | None = None) -> Target:
    """Resolve a target: explicit name, else ``NEURON_PLATFORM_TARGET_OVERRIDE``, else trn3 (as ``nki.simulate``)."""
    if isinstance(name, Target):
        return name
    if name is None:
        name = os.environ.get(ENV_TARGET) or DEFAULT_TARGET
    key = str(name).strip().lower()
    if key in _ALIASES:
        return _ALIASES[key]
    if key in _UNSUPPORTED:
        raise ValueError(
            f"target {name!r} (NeuronCore-v2) is not supported by fusegraph's NKI interpreter; use trn2 or trn3"
        )
    raise ValueError(f"unknown NKI target {name!r}; expected one of trn2|gen3, trn3|gen4")


def resolve_sbuf_budget(target: Target, budget: int | None = None) -> int:
    """Usable SBUF bytes per partition: explicit, else ``FUSEGRAPH_SBUF_BUDGET``, else the target default."""
    if budget is None:
        env = os.environ.get(ENV_SBUF_BUDGET)
        if env:
            budget = int(env, 0)
    if budget is None:
        budget = target.default_sbuf_budget
    if budget <= 0 or budget > target.sbuf_bytes_per_partition:
        raise ValueError(
            f"SBUF budget {budget} must be in (0, {target.sbuf_bytes_per_partition}] bytes per partition on {target.name}"
        )
    return budget
