"""Capture rewrites must not depend on import order.

``import fusegraph.backend`` wraps the forward of the target classes already imported. A model family imported
*after* that (the usual ``import fusegraph`` at the top of a script) used to be wrapped only when the first
compiled graph ran, i.e. after dynamo had traced the step with the original forward: the class change failed
dynamo's guard on the next call (``CodeGuardAccessor ... forward.__closure__``), the step was recompiled, and
that decode call ran a second, new program instead of the one fusegraph reported. fusegraph now wraps the
classes of an HF modeling module as soon as that module is imported.
"""
import subprocess
import sys
import textwrap
import types

from fusegraph.capture.rewrites.base import hf_modeling_classes

SCRIPT = textwrap.dedent(
    """
    import fusegraph.backend  # first, before any transformers model family is imported
    import sys, warnings
    import torch
    from transformers import CompileConfig

    assert "transformers.models.llama.modeling_llama" not in sys.modules, "test premise: llama imported early"
    from fusegraph.capture.session import last_session
    from fusegraph.models import build_decode

    NEW_TOKENS = 3
    model = build_decode("llama-tiny").model
    layer_cls = type(model.model.layers[0])
    assert hasattr(layer_cls.forward, "_fusegraph_original"), "decoder layer not wrapped when llama was imported"

    torch.manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (2, 6))
    mask = torch.ones_like(ids)
    ids[1, :2] = 0
    mask[1, :2] = 0

    def generate(cc=None):
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0, cache_implementation="static", compile_config=cc,
                              output_scores=True, return_dict_in_generate=True)

    ref = generate()
    cc = CompileConfig(backend="fusegraph", fullgraph=False, mode=None,
                       options={"executor": "nkisim", "cache_dir": "off"})
    cc._compile_all_devices = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(cc)
    assert not [str(w.message) for w in caught if "fusegraph" in str(w.message)]
    session = last_session()
    assert session is not None
    assert not session.superseded, f"the step was recompiled: {len(session.superseded)} earlier version(s)"
    (rec,) = session.program.execution.values()
    assert rec.calls == NEW_TOKENS - 1, rec.calls  # every decode call ran the program fusegraph reports
    assert rec.launches_per_call == 1
    assert set(rec.executed_by.values()) == {"nkisim"}, rec.executed_by
    assert set(rec.verification.values()) == {"passed"}, rec.verification
    assert not rec.guard_reruns, rec.guard_reruns
    assert torch.equal(out.sequences, ref.sequences)
    print("OK")
    """
)


def test_backend_imported_before_the_model_runs_every_decode_step():
    """The import order of task F: backend first, model family later; all decode calls of a static-cache
    ``generate`` go through one fusegraph program (no recompile)."""
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "OK" in r.stdout


def test_partially_imported_modeling_module_is_scanned_once_complete():
    """A modeling module still executing (its import triggered another one) is not memoized with the classes it
    has so far; once complete it is scanned."""
    name = "transformers.models.fusegraph_fake.modeling_fusegraph_fake"
    mod = types.ModuleType(name)
    mod.__spec__ = types.SimpleNamespace(_initializing=True)
    mod.A = type("A", (), {"__module__": name})
    seen: dict[str, list[type]] = {}

    def select(m: types.ModuleType) -> list[type]:
        return [v for v in vars(m).values() if isinstance(v, type) and v.__module__ == name]

    sys.modules[name] = mod
    try:
        assert hf_modeling_classes(select, seen) == []
        assert name not in seen
        mod.B = type("B", (), {"__module__": name})
        mod.__spec__._initializing = False
        found = hf_modeling_classes(select, seen)
        assert mod.A in found and mod.B in found
    finally:
        del sys.modules[name]
