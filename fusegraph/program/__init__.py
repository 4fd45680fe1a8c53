"""The program IR (a networkx DiGraph of a whole decode step) and how it is built from ATen graphs."""
from .ir import CapturedGraph, GraphBreak, InputKind, Link, Program, ProgramInput, Ref

__all__ = ["CapturedGraph", "GraphBreak", "InputKind", "Link", "Program", "ProgramInput", "Ref"]
