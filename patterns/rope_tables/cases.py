"""No kernel test cases: the rotary tables are host-side (``register_lowering(..., host_side=True)``), computed on
the eager path and read by the kernel as per-step inputs; no instruction of this op runs in a kernel. The RoPE
that reads them is the rope op (its cases build the same tables)."""
from fusegraph.codegen.api import register_cases

register_cases(__package__, why_none="host-side: the cos/sin tables are computed eagerly and passed to the kernel "
                                     "as per-step inputs; no instruction of this op runs in a kernel")
