"""One torchrun rank of the expert-parallel tests (``tests/tp/test_ep.py``): an HF MoE model loaded with
``DistributedConfig(tp_size=W, ep_size=W)`` (HF's EP: whole experts per rank), its decode step compiled with
fusegraph next to the same EP model run eagerly; what each rank saw goes to ``<out>/<case>.rank<N>.json``.

Usage (by ``tp_harness.run_ranks`` with this file as the worker):
``python -m torch.distributed.run --nproc-per-node N ep_worker.py '<json spec>'``. A case names the family, the
checkpoint, the executor, the steps and the ``DistributedConfig`` fields (``distributed``). Any exception fails
the rank and so torchrun; the harness kills the whole process group at its deadline.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from collections import Counter
from pathlib import Path
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_worker import (  # noqa: E402  (TP worker helpers)
    _program_facts, _reference_vm, _stats, decode_step, greedy_steps, load_model, prefilled)


def _moe_matches(program: Any) -> list[dict]:
    """Every moe_router / moe_experts match of the program: variant, layer, params (expert counts, offsets)."""
    from fusegraph.matching import analyze

    out = []
    for m in analyze(program).matches:
        if m.pattern.template in ("moe_router", "moe_experts") or "moe" in m.pattern.name:
            out.append({"pattern": m.pattern.name, "variant": m.variant, "module": m.module,
                        "params": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                                   for k, v in m.params.items()}})
    return out


def _ep(spec: dict, rank: int) -> dict:
    from transformers.distributed import DistributedConfig

    import fusegraph

    world = dist.get_world_size()
    cfg = DistributedConfig(**spec.get("distributed", {"tp_size": world, "ep_size": world}))
    model = load_model(spec, cfg)
    experts = model.model.layers[0].mlp.experts
    res: dict[str, Any] = {
        "local_experts": int(experts.num_experts),
        "is_expert_parallel": bool(getattr(experts, "_is_expert_parallel", False)),
        "gate_up_type": type(experts.gate_up_proj).__name__,
        "gate_up_local_shape": list((experts.gate_up_proj.to_local() if hasattr(experts.gate_up_proj, "to_local")
                                     else experts.gate_up_proj).shape),
        "router_type": type(model.model.layers[0].mlp.gate.weight).__name__,
    }

    (cache_c, tok), (cache_e, _) = prefilled(model, spec), prefilled(model, spec)
    step = partial(decode_step, model)

    eager = step(cache_e)
    res.update({"tokens_compiled": [], "tokens_eager": [], "logits_compiled": [], "logits_eager": [],
                "prefill_token": tok.reshape(-1).tolist(), "launches": []})
    pos = torch.full((tok.shape[0], 1), 8)
    if spec.get("executor") is None:  # HF's EP run eagerly only
        te = tok
        with torch.no_grad():
            for _ in range(spec.get("steps", 3)):
                b = eager(te, pos)
                res["logits_eager"].append(b[:, -1].float().reshape(-1).tolist())
                te, pos = b[:, -1].argmax(-1, keepdim=True), pos + 1
                res["tokens_eager"].append(te.reshape(-1).tolist())
        return res
    options = {"executor": spec["executor"], "cache_dir": "off", **spec.get("options", {})}
    compiled = torch.compile(step(cache_c), backend="fusegraph", options=options)

    def first_step() -> None:
        if spec["executor"] == "nkisim":
            from fusegraph import nkisim

            res["hbm_read_bytes"] = nkisim.last_profile().hbm_read_bytes  # the step's one launch

    greedy_steps(compiled, eager, tok, spec, res, first_step)
    res["kv_max_diff"] = max(max((lc.keys - le.keys).abs().max().item(), (lc.values - le.values).abs().max().item())
                             for lc, le in zip(cache_c.layers, cache_e.layers))
    cap = fusegraph.last_capture()
    res["graphs"] = len(cap.program.graphs)
    res["executed"] = _stats(cap.program)
    res["kernel_opcodes"] = dict(Counter(ins.opcode for st in cap.program.execution.values()
                                         for plan in getattr(getattr(st, "run", None), "plans", [])
                                         for ins in plan.generated.program.instructions))
    if spec.get("reference_vm"):
        res["reference_vm"] = _reference_vm(cap.program)
    G = cap.program.graph
    res["collective_ops"] = [G.nodes[n]["collective"].op for n in cap.program.collectives()]
    if cap.program.graphs and spec.get("facts", True):  # facts: off for programs the TP helpers do not read
        res.update(_program_facts(cap.program))
        res["moe_matches"] = _moe_matches(cap.program)
        G = cap.program.graph
        res["op_counts"] = dict(Counter(str(d.get("op")) for _, d in G.nodes(data=True) if d.get("op")))
    return res


def main(spec: dict) -> None:
    """Run each case of ``spec["cases"]`` in this one launch; case ``name`` writes ``<out>/<name>.rank<N>.json``."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("collective_timeout_s", 60)))
    rank = dist.get_rank()
    try:
        for case in spec["cases"]:
            torch._dynamo.reset()
            res = _ep(case, rank)
            res["rank"] = rank
            res["world_size"] = dist.get_world_size()
            Path(spec["out"], f"{case['name']}.rank{rank}.json").write_text(json.dumps(res, default=str))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def fake(cases: list[dict]) -> None:
    """Each case one rank alone (``rank`` of ``world``) on torch's fake process group: HF's EP code runs as on that
    rank, but every collective is a no-op (each rank's partial MoE sum stays partial, in the compiled step and in
    the eager reference alike). Kernel collectives cannot run there, so the cases disable the collective patterns:
    the all-reduces stay eager host ops between kernels. Case ``out``: where its result goes."""
    from fusegraph.modelperf.tp import fake_rank

    for spec in cases:
        torch._dynamo.reset()
        os.environ.update(WORLD_SIZE=str(spec["world"]), RANK=str(spec["rank"]), LOCAL_RANK=str(spec["rank"]))
        with fake_rank(spec["world"], spec["rank"]):
            res = _ep(spec, spec["rank"])
        res["rank"] = spec["rank"]
        Path(spec["out"]).write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if sys.argv[1] == "--fake":
        fake(json.loads(sys.argv[2]))
    else:
        main(json.loads(sys.argv[1]))
