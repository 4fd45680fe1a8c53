"""The AST allow-list and the static kernel contract, construct by construct."""
import ast

import pytest
import torch

from fusegraph.llm.contract import check_contract
from fusegraph.llm.examples import PROMPT_EXAMPLE_KINDS, prompt_example
from fusegraph.llm.safety import check_safety
from fusegraph.llm.task import KernelTask, TensorSpec

from . import kernels as K


def findings(src: str) -> list[str]:
    return [str(f) for f in check_safety(ast.parse(src))]


def body(code: str) -> str:
    """A kernel whose body is ``code`` (indented)."""
    lines = "\n".join("    " + ln for ln in code.splitlines())
    return K.HEADER + f"\n\n@nki.jit\ndef k(x, b):\n{lines}\n    return x\n"


def test_good_kernels_pass():
    assert findings(K.GOOD) == []
    for kind in PROMPT_EXAMPLE_KINDS:
        assert findings(prompt_example(kind).source) == [], kind
    ok = body("import_ = math_ = 1\nfor i in range(len(x.shape)):\n    pass\ny = [a for a in (1, 2)]\n"
              "z = {'a': 1}.get('a')\nw = x.reshape((4, 64)).ap(pattern=[[64, 4], [1, 64]], offset=0)")
    assert findings(ok.replace("import nki\n", "import math\nimport nki\n")) == []
    # a parameter may shadow a harmless builtin
    assert findings(K.HEADER + "\n\n@nki.jit\ndef k(input, filter):\n    return input\n") == []
    assert findings(K.HEADER + "import math\n\nC = math.sqrt(2.0)\n") == []


@pytest.mark.parametrize("code, words", [
    ("import subprocess", "import of 'subprocess' is not allowed"),
    ("import nki.language as nl\nimport os.path", "import of 'os.path' is not allowed"),
    ("from os import system", "import from 'os' is not allowed"),
    ("from . import helper", "import from '.' is not allowed"),
    ("import builtins", "import of 'builtins' is not allowed"),
    ("from nki.language import *", "'import *' is not allowed"),
    ("print('hi')", "expr statement at module level"),
    ("class Tiles:\n    pass", "class definitions are not allowed"),
])
def test_module_level_constructs(code, words):
    got = findings(K.HEADER + code + "\n")
    assert any(words in f for f in got), got


@pytest.mark.parametrize("code, words", [
    ("y = torch.ones(3)", "'torch' is not allowed: the kernel computes with torch"),
    ("y = np.zeros(3)", "'np' is not allowed: the kernel computes with NumPy"),
    ("y = sys.modules", "'sys' is not allowed"),
    ("y = open('/etc/passwd')", "the builtin 'open' is not allowed"),
    ("exec('y = 1')", "the builtin 'exec' is not allowed"),
    ("y = eval('1')", "the builtin 'eval' is not allowed"),
    ("y = compile('1', 'f', 'eval')", "the builtin 'compile' is not allowed"),
    ("y = __import__('os')", "the name '__import__' is not allowed"),
    ("y = globals()", "the builtin 'globals' is not allowed"),
    ("y = locals()", "the builtin 'locals' is not allowed"),
    ("y = vars(x)", "the builtin 'vars' is not allowed"),
    ("y = getattr(nl, 'add')", "the builtin 'getattr' is not allowed"),
    ("y = hasattr(nisa, 'fused_op')", "the builtin 'hasattr' is not allowed"),
    ("setattr(x, 'shape', 1)", "the builtin 'setattr' is not allowed"),
    ("y = type(x)", "the builtin 'type' is not allowed"),
    ("y = x.__class__", "private attribute '.__class__'"),
    ("y = ().__class__.__bases__[0].__subclasses__()", "private attribute '.__subclasses__'"),
    ("y = x._st", "private attribute '._st'"),
    ("y = x.numpy()", "attribute '.numpy' is not part of the NKI tensor API"),
    ("y = x.storage.data", "attribute '.storage' is not part of the NKI tensor API"),
    ("y = '{0.shape}'.format(x)", "str.format is not allowed"),
    ("y = '__class__'", "string constants containing '__'"),
    ("try:\n    y = 1\nexcept Exception:\n    y = 2", "try/except is not allowed"),
    ("global G", "global statements are not allowed"),
    ("with open('f') as fh:\n    pass", "only 'with nl.no_reorder():'"),
    ("def inner():\n    yield 1", "generators are not allowed"),
    ("import math", "imports belong at the top"),
    ("y = math.__dict__", "private attribute '.__dict__'"),
    ("y = __builtins__", "the name '__builtins__' is not allowed"),
])
def test_kernel_body_constructs(code, words):
    got = findings(body(code).replace("import nki\n", "import math\nimport nki\n"))
    assert any(words in f for f in got), got


def test_only_nki_jit_decorates():
    src = K.HEADER + "import math\n\n\ndef deco(f):\n    return f\n\n\n@deco\ndef k(x):\n    return x\n"
    assert any("only @nki.jit may decorate" in f for f in findings(src))


def test_host_reaching_findings_are_listed_first():
    got = findings(body("y = open('f').read()"))
    assert "open" in got[0] and "'.read'" in got[1]


TASK = KernelTask("t", "def reference(x, b):\n    return x + b\n", lambda x, b: x + b,
                  [TensorSpec("x", (4, 64), torch.float32), TensorSpec("b", (4, 64), torch.float32)],
                  [TensorSpec("out", (4, 64), torch.float32)])


def contract(src: str, task: KernelTask = TASK) -> list[str]:
    return [str(f) for f in check_contract(ast.parse(src), task)[1]]


def test_contract_accepts_the_good_kernel_and_helpers():
    assert contract(K.GOOD) == []
    helper = K.HEADER + (
        "\n\ndef add_into(dst, a, b):\n    nisa.tensor_tensor(dst=dst, data1=a, data2=b, op=nl.add)\n\n\n"
        "@nki.jit\ndef k(x, b):\n    out = nl.ndarray(shape=(4, 64), dtype=nl.float32, buffer=nl.shared_hbm)\n"
        "    add_into(out, x, b)\n    return out\n")
    assert contract(helper) == []


@pytest.mark.parametrize("src, words", [
    (K.HEADER + "\n\ndef k(x, b):\n    return x\n", "no @nki.jit kernel function found"),
    (K.GOOD + "\n\n@nki.jit\ndef k2(x, b):\n    return x\n", "2 @nki.jit functions"),
    (K.GOOD.replace("def scaled_add(x, b):", "def scaled_add(x):"), "takes 1 parameter(s) but the task has 2"),
    (K.GOOD.replace("def scaled_add(x, b):", "def scaled_add(*args):"), "plain positional parameters"),
    (K.GOOD.replace("    return out\n", "    return out, out\n"), "returns 2 value(s) but the task has 1"),
    (K.GOOD.replace("    return out\n", ""), "the kernel returns nothing"),
    (K.RETURNS_INPUT, "returns its input 'x'"),
    (K.COPY_ONLY, "never calls an NKI compute instruction"),
])
def test_contract_findings(src, words):
    got = contract(src)
    assert any(words in f for f in got), got


def test_in_place_outputs_and_data_movement_regions():
    inplace = K.HEADER + (
        "\n\n@nki.jit\ndef k(cache, row):\n    t = nl.ndarray(shape=(1, 64), dtype=nl.float32, buffer=nl.sbuf)\n"
        "    nisa.dma_copy(dst=t, src=row)\n    nisa.dma_copy(dst=cache[0:1, :], src=t)\n    return cache\n")
    spec = [TensorSpec("cache", (4, 64), torch.float32), TensorSpec("row", (1, 64), torch.float32)]
    moving = KernelTask("w", "def reference(cache, row):\n    cache[0] = row[0]\n    return cache\n", lambda c, r: c,
                        spec, [TensorSpec("cache", (4, 64), torch.float32, alias_of="cache")], data_movement_only=True)
    assert contract(inplace, moving) == []
    computing = KernelTask("w", moving.reference_source, moving.reference, spec, moving.outputs)
    assert any("never calls an NKI compute" in f for f in contract(inplace, computing))
    not_alias = KernelTask("w", moving.reference_source, moving.reference, spec,
                           [TensorSpec("cache", (4, 64), torch.float32)], data_movement_only=True)
    assert any("returns its input 'cache'" in f for f in contract(inplace, not_alias))
