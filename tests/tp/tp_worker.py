"""One torchrun rank of the tensor-parallel tests (``tests/tp``): run a TP model's decode step compiled with fusegraph
next to the same TP model run eagerly, and write what each rank saw to ``<out>/rank<N>.json``.

Usage (by :mod:`tp_harness`): ``python -m torch.distributed.run --nproc-per-node N tp_worker.py '<json spec>'``.
The spec names the case (``kind``: ``hf`` for a checkpoint loaded with ``DistributedConfig(tp_plan="auto")``,
``block`` for torch's own ``parallelize_module`` on a small attention + MLP block), the executor and the number
of steps. Any exception fails the rank and so torchrun; the harness kills the whole process group at its deadline.
"""
from __future__ import annotations

import datetime
import json
from collections import Counter
import os
import sys
import warnings
from pathlib import Path
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from fusegraph.warnings import reset_warnings


def _collectives(program: Any) -> list[dict]:
    G = program.graph
    out = []
    for n in program.collectives():
        d = G.nodes[n]
        c = d["collective"]
        out.append({"node": n, "op": c.op, "reduce_op": c.reduce_op, "group": c.group.to_dict(),
                    "group_size": c.group_size, "module": d.get("module"), "layer": d.get("layer"),
                    "shape": list(d["shape"]) if d.get("shape") else None, "wait": c.wait,
                    "inputs": [list(G.nodes[i]["shape"]) for i in c.inputs]})
    return out


def _program_facts(program: Any) -> dict:
    from fusegraph.matching import analyze
    from fusegraph.matching.verify import verify_match

    G = program.graph
    hazards = [(u, v) for u, v, e in G.edges(data=True) if e.get("collective")]
    analysis = analyze(program)
    facts: dict[str, Any] = {
        "collectives": _collectives(program),
        "collective_hazards": [[u, v] for u, v in hazards],
        "sharded_inputs": [p.to_dict() for p in program.inputs() if p.sharding is not None],
        "mesh_inputs": [n for n, d in G.nodes(data=True) if d.get("device_mesh") is not None],
        "pattern_counts": dict(sorted(Counter(m.pattern.name for m in analysis.matches).items())),
        "collective_matches": [{"pattern": m.pattern.name, "variant": m.variant, "module": m.module,
                                "params": {k: v for k, v in m.params.items() if k != "ranks"},
                                "ranks": list(m.params.get("ranks") or [])}
                               for m in analysis.matches if m.pattern.template in ("all_reduce", "all_gather")],
        "regions": [{"id": r.id, "kind": r.kind, "ops": r.op_count, "layers": list(r.layers)}
                    for r in analysis.regions],
        "unmatched": sorted({u.op for u in analysis.unmatched}),
        "unmatched_detail": [u.to_dict() for u in analysis.unmatched],
    }
    # every collective match recomputed with the pattern's reference, i.e. the real collective on this job's
    # group, from the values of one eager run of the program (every rank runs the same collectives in the same
    # order: the program's, then the matches')
    values, before = _program_values(program)
    facts["verify"] = [{"match": r.variant, "err": r.max_abs_err, "ok": bool(r.ok)}
                       for r in (verify_match(m, values, before) for m in analysis.matches
                                 if m.pattern.template in ("all_reduce", "all_gather"))]
    facts["verify_bad"] = []
    for m in analysis.matches:
        if m.pattern.template in ("all_reduce", "all_gather"):
            continue
        try:
            r = verify_match(m, values, before)
        except NotImplementedError:  # a generic piece: verified against its own ATen ops by codegen
            continue
        if not r.ok:
            facts["verify_bad"].append(r.variant)
    return facts


def _program_values(program: Any) -> tuple[dict, dict]:
    """Every node's value in one eager run of the (one-graph) program on seeded inputs."""
    from fusegraph.executors.eager import build_plan, run_plan

    g = torch.Generator().manual_seed(1)
    env: dict = {}
    gi = program.graphs[-1].index
    for pin in program.captured(gi).inputs:
        if pin.dtype is None:
            # the device mesh (read by no ATen op), or a Python int of the step (a sliding-window cache layer's
            # cumulative_length_int: the 8 prompt positions)
            env[pin.node] = None if program.graph.nodes[pin.node].get("device_mesh") is not None else 8
            continue
        dt = getattr(torch, pin.dtype)
        if dt.is_floating_point:
            env[pin.node] = (torch.randn(pin.shape, generator=g) * 0.5).to(dt)
        elif pin.shape == ():
            env[pin.node] = torch.tensor(5, dtype=dt)
        else:
            env[pin.node] = torch.zeros(pin.shape, dtype=dt)
    before = {k: v.clone() for k, v in env.items() if isinstance(v, torch.Tensor)}
    run_plan(build_plan(program, program.topo_order(gi)), env)
    return env, before


def _stats(program: Any) -> dict:
    """What the executor did per graph; for NKI kernels also which collective nodes each kernel covers (with the
    collective lowering: all of them, in one kernel; with the collective patterns disabled: none)."""
    out = {}
    collectives = set(program.collectives())
    for gi, st in program.execution.items():
        run = getattr(st, "run", None)
        kernels = [{"label": p.label, "disabled": bool(p.disabled),
                    "collectives": sorted(collectives & set(p.lowered.kernel_nodes)),
                    "opcodes": [i.opcode for i in p.lowered.program.instructions],
                    # the embedding's ops the kernel does not compute (host glue before it)
                    "embed_ops_outside": sorted(n for n, d in program.graph.nodes(data=True)
                                                if d.get("kind") == "op" and d.get("module") == "model.embed_tokens"
                                                and n not in p.lowered.kernel_nodes)}
                   for p in getattr(run, "plans", [])]
        # the execution record of the executors being reworked (program/execution.py): one entry per region
        kernels += [{"label": f"region {rr.region_id}", "disabled": bool(rr.disabled),
                     "collectives": sorted(collectives & set(rr.kernel_nodes))} for rr in getattr(st, "regions", [])]
        out[str(gi)] = {"executed_by": {str(k): v for k, v in getattr(st, "executed_by", {}).items()},
                        "verification": {str(k): v for k, v in getattr(st, "verification", {}).items()},
                        "launches_per_call": getattr(st, "launches_per_call", None), "kernels": kernels}
    return out


class _CorruptKernel:
    """``corrupt_rank``: on that rank only, every kernel's first output (the logits) comes back off by 1, so its
    first-call verification against eager fails there and passes on the other ranks (the rank-agreement test);
    with ``corrupt_mode: "raise"`` its launches raise instead, before the kernel issues any collective (its peers'
    kernels then wait in their first collective until the interpreter's sync timeout)."""

    def __init__(self, rank: int, spec: dict):
        self.active = spec.get("corrupt_rank") == rank
        self.raises = spec.get("corrupt_mode") == "raise"
        self.saved = None

    def __enter__(self) -> "_CorruptKernel":
        if self.active:
            from fusegraph.executors.nki import NkiExecutor

            self.saved = NkiExecutor.make_runner

            def make_runner(executor, plan, settings, _orig=self.saved, _raises=self.raises):
                run = _orig(executor, plan, settings)

                def corrupt(args):
                    if _raises:
                        raise RuntimeError("injected kernel failure on this rank")
                    return [o + 1 if i == 0 else o for i, o in enumerate(run(args))]

                return corrupt

            NkiExecutor.make_runner = make_runner
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.saved is not None:
            from fusegraph.executors.nki import NkiExecutor

            NkiExecutor.make_runner = self.saved


def _kernel_collectives() -> list:
    """The collectives the interpreter ran inside the last kernel launch (its profile: op, buffer, count, bytes)."""
    from fusegraph import nkisim

    try:
        prof = nkisim.last_profile()
    except LookupError:  # no kernel ran in this process (every rank fell back, e.g. ranks configured differently)
        return []
    return [{k: r[k] for k in ("op", "buffer", "group", "count", "bytes", "program")}
            for r in (getattr(prof, "collectives", None) or [])]


def _reference_vm(program: Any) -> list[dict]:
    """Each kernel's program run by the codegen reference VM (``codegen/reference.py``: the instructions in PyTorch;
    ``AllReduce``/``AllGather`` do the real collective on this job) on the latest call's inputs, against the
    graph's eager values: max |diff| of each kernel output (every rank runs it, so the collectives pair up)."""
    from fusegraph.codegen import reference
    from fusegraph.executors.eager import build_plan, run_plan
    from fusegraph.executors.kernel_args import marshal_input

    out = []
    for gi, record in program.execution.items():
        run = getattr(record, "run", None)
        if run is None or run.last_args is None:
            continue
        clone = lambda args: [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # noqa: E731
        env = dict(zip(run.input_ids, clone(run.last_args)))
        run_plan(build_plan(program, program.topo_order(gi)), env)
        before = dict(env)
        before.update(zip(run.input_ids, clone(run.last_args)))  # the state as it was before the step
        for plan in run.plans:
            ref_env = {name: (marshal_input(src, plan.generated.specs[name].dtype, before[src.node])
                              if src.kind == "input" else src.value(before[src.node]).clone())
                       for name, src in plan.lowered.args.items()}
            reference.run(plan.lowered.program, ref_env)
            for name, node in plan.lowered.outputs.items():
                want = env[node].float().reshape(-1)
                got = ref_env[name].float().reshape(-1)
                out.append({"kernel": plan.generated.name, "output": node,
                            "max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item()})
    return out


def load_model(spec: dict, distributed_config: Any) -> Any:
    """The spec's HF model (``family``, ``dir``, ``dtype``, ``attn``, ``experts``) loaded with HF-native parallelism."""
    import transformers

    kw = {"attn_implementation": spec.get("attn", "eager")}
    if spec.get("experts"):
        kw["experts_implementation"] = spec["experts"]
    if spec.get("fusegraph_plan"):  # fusegraph.apply_tp_plan on the config before HF shards (test_tp_plans.py)
        import torch.distributed as dist

        import fusegraph

        config = fusegraph.apply_tp_plan(transformers.AutoConfig.from_pretrained(spec["dir"]), dist.get_world_size())
        config.base_model_tp_plan.update(spec.get("plan_override", {}))  # a rule replaced: the negative controls
        kw["config"] = config
    cls = getattr(transformers, spec["family"] + "ForCausalLM")
    return cls.from_pretrained(spec["dir"], distributed_config=distributed_config,
                               dtype=getattr(torch, spec.get("dtype", "float32")), **kw).eval()


def prefilled(model: Any, spec: dict) -> tuple[Any, torch.Tensor]:
    """A static cache prefilled with the same 8-token prompt on every rank (and in the single-process reference),
    and the greedy token after it."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=32)
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (spec.get("batch", 1), 8))
    with torch.no_grad():
        logits = model(input_ids=prompt, cache=cache, use_cache=True).logits
    return cache, logits[:, -1].argmax(-1, keepdim=True)


def decode_step(model: Any, cache: Any) -> Any:
    """The decode step the tests compile: one token per sequence at the given positions, the logits."""
    return lambda t, p: model(input_ids=t, cache=cache, position_ids=p, use_cache=True).logits


def greedy_steps(compiled: Any, eager: Any, tok: torch.Tensor, spec: dict, res: dict,
                 first_step: Any = None) -> None:
    """``spec["steps"]`` greedy decode steps of the compiled and the eager step side by side from position 8: per
    step the kernel launches of each graph, whether both return plain tensors, both logits and tokens; the
    FusegraphWarnings seen (``res["warnings"]``); ``first_step()`` after the first step (what the step's kernels
    recorded)."""
    import fusegraph

    for k in ("tokens_compiled", "tokens_eager", "logits_compiled", "logits_eager", "same_type", "launches"):
        res[k] = []
    tc, te = tok, tok
    pos = torch.full((tok.shape[0], 1), 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for i in range(spec.get("steps", 3)):
            a, b = compiled(tc, pos), eager(te, pos)
            res["launches"].append([getattr(st, "launches_per_call", None)
                                    for st in fusegraph.last_capture().program.execution.values()])
            if i == 0:
                res["kernel_collectives"] = _kernel_collectives() if spec.get("executor") == "nkisim" else []
                if first_step is not None:
                    first_step()
            res["same_type"].append(type(a) is type(b) is torch.Tensor)
            res["logits_compiled"].append(a[:, -1].float().reshape(-1).tolist())
            res["logits_eager"].append(b[:, -1].float().reshape(-1).tolist())
            tc, te, pos = a[:, -1].argmax(-1, keepdim=True), b[:, -1].argmax(-1, keepdim=True), pos + 1
            res["tokens_compiled"].append(tc.reshape(-1).tolist())
            res["tokens_eager"].append(te.reshape(-1).tolist())
    res["warnings"] = [str(w.message) for w in caught if issubclass(w.category, fusegraph.FusegraphWarning)]


def _cache_state(layer: Any) -> list[torch.Tensor]:
    """A cache layer's state tensors: keys and values of an attention layer, the conv states of a conv layer (LFM2)."""
    kv = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
    conv = getattr(layer, "conv_states", None) or {}
    return kv + [t for _, t in sorted(conv.items()) if t is not None]


def _hf(spec: dict, rank: int) -> dict:
    from transformers.distributed import DistributedConfig

    import fusegraph

    tp = DistributedConfig(tp_plan=spec.get("tp_plan", "auto"))  # a dict overrides single rules of the model's plan
    model = load_model(spec, tp)
    (cache_c, tok), (cache_e, _) = prefilled(model, spec), prefilled(model, spec)
    step = partial(decode_step, model)

    options = {"executor": spec.get("executor", "eager"), "cache_dir": "off", **spec.get("options", {}),
               **spec.get("rank_options", {}).get(str(rank), {})}  # one rank built otherwise (rank agreement)
    compiled = torch.compile(step(cache_c), backend="fusegraph", options=options)
    corrupt = _CorruptKernel(rank, spec)
    eager = step(cache_e)
    res: dict[str, Any] = {"prefill_token": tok.reshape(-1).tolist()}
    with corrupt:
        greedy_steps(compiled, eager, tok, spec, res)
    pairs = [(a, b) for lc, le in zip(cache_c.layers, cache_e.layers)
             for a, b in zip(_cache_state(lc), _cache_state(le))]
    res["kv_equal"] = all(torch.equal(a, b) for a, b in pairs)
    res["kv_max_diff"] = max((a - b).abs().max().item() for a, b in pairs)
    res["kv_local_shape"] = next(list(lc.keys.shape) for lc in cache_c.layers if getattr(lc, "keys", None) is not None)
    res["state_local_shapes"] = [list(t.shape) for lc in cache_c.layers for t in _cache_state(lc)]
    res["sharded_weight"] = type(next(p for n, p in model.named_parameters() if n.endswith("q_proj.weight"))).__name__
    cap = fusegraph.last_capture()
    res["graphs"] = len(cap.program.graphs)
    res["summary"] = cap.format()  # the capture summary and the region report work on a TP program
    from fusegraph.report import report_for_session

    report = json.loads(json.dumps(report_for_session(cap.session).to_dict(), default=str))
    res["report_regions"] = len(report["regions"])
    res["refusals"] = [str(r.reason) for r in getattr(cap.session, "refusals", [])] if hasattr(cap, "session") else []
    res["executed"] = _stats(cap.program)
    if spec.get("reference_vm"):
        res["reference_vm"] = _reference_vm(cap.program)
    if cap.program.graphs:
        res.update(_program_facts(cap.program))
    return res


class Block(torch.nn.Module):
    """A decoder-like block for ``parallelize_module``: RMSNorm, q/k/v (colwise), attention over the local heads,
    o (rowwise), RMSNorm, gate/up (colwise), SiLU gate, down (rowwise), residual adds."""

    def __init__(self, hidden: int = 64, heads: int = 4, inter: int = 128):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm1 = torch.nn.RMSNorm(hidden, eps=1e-6)
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.v_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-6)
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = torch.softmax(q @ k.transpose(-1, -2) * self.head_dim ** -0.5, dim=-1) @ v  # local heads only
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def _block(spec: dict, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fusegraph

    torch.manual_seed(0)
    block = Block()
    single = Block()
    single.load_state_dict(block.state_dict())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel(), "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel()}
    parallelize_module(block, mesh, plan)
    torch.manual_seed(1)
    x = torch.randn(1, 3, 64)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = torch.compile(block, backend="fusegraph", options={"executor": spec.get("executor", "eager"),
                                                                 "cache_dir": "off"})(x)
        ref = block(x)
        ref_single = single(x)
    cap = fusegraph.last_capture()
    res = {"type": type(out).__name__, "equal_tp_eager": bool(torch.equal(out, ref)),
           "max_diff_tp_eager": (out - ref).abs().max().item(),
           "max_diff_single": (out - ref_single).abs().max().item(),
           "warnings": [str(w.message) for w in caught if issubclass(w.category, fusegraph.FusegraphWarning)],
           "sharded_weight": type(block.q_proj.weight).__name__}
    res.update(_program_facts(cap.program))
    return res


def main(spec: dict) -> None:
    """Run each case of ``spec["cases"]`` (one torchrun launch for several cases: starting ranks is the slow
    part); case ``name`` writes ``<out>/<name>.rank<N>.json``."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("collective_timeout_s", 60)))
    rank = dist.get_rank()
    try:
        for case in spec["cases"]:
            torch._dynamo.reset()
            reset_warnings()  # each case sees its own warnings (fusegraph deduplicates them per process)
            saved_env = _set_rank_env(case, rank)
            try:
                res = _run_case(case, rank)
            finally:
                os.environ.clear()
                os.environ.update(saved_env)
            res["rank"] = rank
            res["world_size"] = dist.get_world_size()
            Path(spec["out"], f"{case['name']}.rank{rank}.json").write_text(json.dumps(res, default=str))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _set_rank_env(case: dict, rank: int) -> dict[str, str]:
    """``rank_env``: ``FUSEGRAPH_*`` variables set on one rank only for this case (ranks configured differently, the
    rank-agreement tests); returns the environment to restore."""
    saved = dict(os.environ)
    os.environ.update({k: str(v) for k, v in case.get("rank_env", {}).get(str(rank), {}).items()})
    return saved


def _run_case(case: dict, rank: int) -> dict:
    if not case.get("expect_error"):
        return _hf(case, rank) if case["kind"] == "hf" else _block(case, rank)
    try:  # a case that may be refused (HF's plan): record the error, go on
        return _hf(case, rank)
    except Exception as e:  # noqa: BLE001 -- the test asserts what was raised
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(json.loads(sys.argv[1]))
