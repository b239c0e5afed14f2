"""A script that attaches co-serving without an ``if __name__ == "__main__":`` guard (the README
example, copied carelessly) gets an error that says what to do."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_unguarded_script_is_told_to_guard_its_entry_point(tmp_path, base_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from deltaserve.core.slo import SLOConfig
        from deltaserve.hosts.native import EngineConfig, LLMEngine
        from deltaserve.train.config import CoServeConfig
        from tests.train import fixtures as fx

        engine = LLMEngine(EngineConfig(model={str(base_path)!r}, dtype="float32"))
        engine.attach(CoServeConfig(SLOConfig(2.0, 0.5)), dataset=fx.samples(4),
                      latency_model=fx.latency_model(), progress=False)
        print("attached")
    """))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "attached" not in done.stdout
    assert 'if __name__ == "__main__":' in done.stderr
