import subprocess
import sys


def test_core_imports_no_torch_and_no_engine():
    code = (
        "import sys, deltaserve.core\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'vllm', 'sglang', 'transformers', 'peft')]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_star_import_names_only_what_core_defines():
    # every name of __all__ must exist: a stale entry makes ``import *`` raise AttributeError
    import deltaserve.core as core

    ns: dict[str, object] = {}
    exec("from deltaserve.core import *", ns)
    assert set(core.__all__) <= ns.keys()
    assert len(set(core.__all__)) == len(core.__all__)
