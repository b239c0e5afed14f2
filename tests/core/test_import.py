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
