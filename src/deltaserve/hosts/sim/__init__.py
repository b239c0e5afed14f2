"""The simulated GPU host's timing layer: a step-time oracle built from measured GPU profiles
(Vidur's A100 data), plus documented models of what the profiles lack. See ``docs/sim.md``.

Pure numpy; no engine and no torch is imported here.
"""
