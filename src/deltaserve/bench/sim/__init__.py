"""The benchmark on the simulated GPU host: the paper's experiments, sensitivity, the CPU
validation and capacity planning (``deltaserve bench --host sim``, ``deltaserve plan``)."""
