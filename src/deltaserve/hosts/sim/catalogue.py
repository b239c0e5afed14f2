"""Which (GPU, model) profiles exist, and where the profile data lives.

The data are Vidur's public profiles (``shared/data/vidur``), loaded by path and never copied into
the repository. A plan or bench for a GPU or model without an entry here is refused with the list
of what exists, before anything is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from deltaserve.core.errors import InputError

DATA_DIR_ENV = "DELTASERVE_SHARED_DATA"
VIDUR_SOURCE = "vidur"
PROBE_SOURCE = "h200-probe"


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the oracle needs beyond the profiles (from the model's config.json)."""

    num_layers: int
    hidden: int
    ffn: int
    vocab: int
    num_q_heads: int
    num_kv_heads: int
    max_context: int  # max_position_embeddings

    @property
    def num_params(self) -> int:
        """Weights: embedding and LM head (untied), per layer the attention and MLP projections
        and two norms, and the final norm."""
        kv = self.num_kv_heads * self.head_dim
        layer = (2 * self.hidden * self.hidden + 2 * self.hidden * kv
                 + 3 * self.hidden * self.ffn + 2 * self.hidden)
        return 2 * self.vocab * self.hidden + self.num_layers * layer + self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_q_heads

    def kv_bytes_per_token_per_layer(self, tp: int, bytes_per_elem: int = 2) -> int:
        """K and V of one cached token in one layer on one GPU (its share of the KV heads)."""
        return 2 * (self.num_kv_heads // tp) * self.head_dim * bytes_per_elem


@dataclass(frozen=True)
class ProfileEntry:
    """One (GPU, model) pair with measured profiles.

    ``tp_degrees``: tensor-parallel degrees the oracle serves. ``attention_tp_measured``: those
    with measured attention rows; every other degree's attention is derived from TP1 by splitting
    the KV heads (see ``attention.py``). ``networks``: collective profiles that pair with this GPU,
    the first being the default. ``source``: ``vidur`` (per-operator profiles under the Vidur
    data) or ``h200-probe`` (whole steps measured on the GPU, ``compute_subdir`` a file under the
    shared data; see ``h200.py``).
    """

    gpu: str
    model: str
    compute_subdir: str
    shape: ModelShape
    tp_degrees: tuple[int, ...]
    attention_tp_measured: tuple[int, ...]
    networks: tuple[str, ...]
    gpu_memory_bytes: int
    source: str = VIDUR_SOURCE

    @property
    def default_network(self) -> str | None:
        return self.networks[0] if self.networks else None


# Meta-Llama-3-8B's config.json: 32 layers, hidden 4096, intermediate 14336, vocab 128256,
# 32 query heads, 8 KV heads, 8,192 positions (8.03 B parameters). The profile CSVs carry the
# same shape columns (checked on load).
LLAMA_3_8B = ModelShape(num_layers=32, hidden=4096, ffn=14336, vocab=128256, num_q_heads=32,
                        num_kv_heads=8, max_context=8192)

# a100_pairwise_nvlink first: it is Vidur's default network for its A100 SKU (a node of 4 A100s
# bridged by NVLink in pairs, where the compute profiles were taken); a100_dgx (NVSwitch) is the
# alternative for an SXM/HGX machine. TP8 has MLP rows but no attention rows and needs a second
# node on the pairwise machine, so it is not offered.
CATALOGUE: dict[tuple[str, str], ProfileEntry] = {
    ("a100", "llama-3-8b"): ProfileEntry(
        gpu="a100", model="llama-3-8b",
        compute_subdir="compute/a100/meta-llama/Meta-Llama-3-8B",
        shape=LLAMA_3_8B, tp_degrees=(1, 2, 4), attention_tp_measured=(1, 4),
        networks=("a100_pairwise_nvlink", "a100_dgx"),
        # Vidur's A100 SKU is the 80 GB part (the profiles' HBM bandwidth agrees: docs/sim.md)
        gpu_memory_bytes=80 * 2**30),
    # one H200 measured whole-step (shared/data/h200/README.md): TP1 only, no network profile
    ("h200", "llama-3-8b"): ProfileEntry(
        gpu="h200", model="llama-3-8b", compute_subdir="h200/probe.json", shape=LLAMA_3_8B,
        tp_degrees=(1,), attention_tp_measured=(1,), networks=(),
        # probe.json s0_env: 139.8 GiB total as torch reports it
        gpu_memory_bytes=int(139.8 * 2**30), source=PROBE_SOURCE),
}


def available_profiles() -> list[str]:
    return [f"{gpu}/{model}" for gpu, model in sorted(CATALOGUE)]


def lookup_profile(gpu: str, model: str) -> ProfileEntry:
    """The catalogue entry, or a clear refusal naming what exists."""
    entry = CATALOGUE.get((gpu.lower(), model.lower()))
    if entry is None:
        raise InputError("gpu/model", f"{gpu}/{model}",
                         f"no measured profile; available: {', '.join(available_profiles())}")
    return entry


def shared_data_candidates() -> list[Path]:
    """Where the shared data is looked for, in order: ``$DELTASERVE_SHARED_DATA``,
    ``../shared/data`` beside the checkout, ``/work/shared/data``."""
    env = os.environ.get(DATA_DIR_ENV)
    # src/deltaserve/hosts/sim/catalogue.py -> the checkout root is parents[4]
    beside = Path(__file__).resolve().parents[4].parent / "shared" / "data"
    return [*([Path(env)] if env else []), beside, Path("/work/shared/data")]


def resolve_shared(relative: str, field: str, explicit: str | Path | None = None) -> Path:
    """A file or directory of the shared data: ``explicit`` if given (it must exist), else
    ``relative`` under the first candidate that has it (:func:`shared_data_candidates`)."""
    if explicit is not None:
        path = Path(explicit)
        if not path.exists():
            raise InputError(field, str(path), "does not exist")
        return path
    candidates = [root / relative for root in shared_data_candidates()]
    for path in candidates:
        if path.exists():
            return path
    raise InputError(field, None, f"not found; looked in {', '.join(map(str, candidates))} "
                     f"(pass a path or set ${DATA_DIR_ENV})")


def resolve_vidur_dir(explicit: str | Path | None = None) -> Path:
    """The Vidur profile directory (``vidur`` under the shared data unless given)."""
    path = resolve_shared("vidur", "vidur_data_dir", explicit)
    if not path.is_dir():
        raise InputError("vidur_data_dir", str(path), "is not a directory")
    return path
