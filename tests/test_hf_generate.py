"""HF's own generation loop with fusegraph as its compile backend (``generate(..., compile_config=...)``), the way
most users will meet it: transformers prefills eagerly, then runs every decode step through the compiled forward
with its own static cache, attention mask and cache positions. Tokens must equal eager generation and each decode
step must be one megakernel launch."""
import warnings

import pytest
import torch
from transformers import CompileConfig

from fusegraph.capture.session import last_session
from fusegraph.models import build_decode

CASES = [
    # (model, batch, left padding of the second prompt)
    ("qwen3-moe-tiny", 1, 0),
    ("llama-tiny", 2, 3),
]


def _generate(model, ids, mask, compile_config=None):
    return model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          cache_implementation="static", compile_config=compile_config,
                          output_scores=True, return_dict_in_generate=True)


@pytest.mark.parametrize("name,batch,pad", CASES, ids=[c[0] for c in CASES])
def test_generate_with_fusegraph_equals_eager(name, batch, pad):
    model = build_decode(name).model
    torch.manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (batch, 8))
    mask = torch.ones_like(ids)
    if pad:
        ids[1, :pad] = 0
        mask[1, :pad] = 0
    ref = _generate(model, ids, mask)
    before = last_session()

    cc = CompileConfig(backend="fusegraph", fullgraph=False, mode=None,
                       options={"executor": "nkisim", "cache_dir": "off"})
    cc._compile_all_devices = True  # transformers only auto-compiles on cuda/xpu/neuron/tpu devices
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _generate(model, ids, mask, cc)
    fusegraph_warnings = [str(w.message) for w in caught if "fusegraph" in str(w.message)]
    assert not fusegraph_warnings, fusegraph_warnings

    session = last_session()
    assert session is not None and session is not before, "generate did not compile the decode step with fusegraph"
    (stats,) = session.program.execution.values()
    assert stats.launches_per_call == 1 and set(stats.executed_by.values()) == {"nkisim"}
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


def test_generate_sliding_window_padded_batch_once_the_window_is_full():
    """Mistral with a 32-position sliding window, a padded batch of 2, generating past the window: once HF's cache
    rolls, the step recompiles (the rolled version runs its roll inside the kernel, patterns/sliding_window_cache.py;
    tests/serving/test_window_roll.py checks that), the run never raises and the tokens equal eager generation."""
    from fusegraph.models import build_family_decode

    model = build_family_decode("Mistral", sliding_window=32).model
    torch.manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (2, 8))
    mask = torch.ones_like(ids)
    ids[1, :3] = 0
    mask[1, :3] = 0

    def gen(cc=None):
        return model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                              cache_implementation="static", compile_config=cc, output_scores=True,
                              return_dict_in_generate=True)

    ref = gen()
    cc = CompileConfig(backend="fusegraph", fullgraph=False, mode=None,
                       options={"executor": "nkisim", "cache_dir": "off"})
    cc._compile_all_devices = True
    out = gen(cc)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
