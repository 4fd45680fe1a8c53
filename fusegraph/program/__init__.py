"""The program IR (a networkx DiGraph of a whole decode step), how it is built from ATen graphs, and the
executors' records of how its graphs ran (``execution``)."""
from .execution import ExecutionRecord, IslandRun, KernelInfo, RegionRun
from .ir import CapturedGraph, GraphBreak, InputKind, Link, Program, ProgramInput, Ref

__all__ = ["CapturedGraph", "ExecutionRecord", "GraphBreak", "InputKind", "IslandRun", "KernelInfo", "Link",
           "Program", "ProgramInput", "Ref", "RegionRun"]
