"""The one dtype table (flexpipe_dag/core/dtypes.py) and the planner's use of it."""

import pytest

from flexpipe_dag.core.dtypes import DTYPE_NAMES, canonical_dtype, compute_dtype, dtype_bytes, lookup_dtype
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.model_spec import DTYPE_BYTES, kv_dtype_bytes


def test_table_names_bytes_and_torch_names():
    assert DTYPE_NAMES == ("fp32", "bf16", "fp16", "int8", "int4")
    assert DTYPE_BYTES == {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
    assert [lookup_dtype(n).torch_name for n in DTYPE_NAMES] == ["float32", "bfloat16", "float16", None, None]
    assert [canonical_dtype(a) for a in ("float32", "bfloat16", "float16", "fp16")] == ["fp32", "bf16", "fp16", "fp16"]
    assert dtype_bytes("bfloat16") == 2.0 and kv_dtype_bytes("float32") == 4.0 and kv_dtype_bytes("int4") == 2.0


def test_unknown_and_weight_only_dtypes_name_the_field_and_the_accepted_names():
    with pytest.raises(InputError, match=r"^plan.yaml: precision: unknown dtype 'fp7'; expected one of fp32, bf16, "
                                         r"fp16, int8, int4 \(or float32, bfloat16, float16\)$"):
        lookup_dtype("fp7", "plan.yaml", "precision")
    with pytest.raises(InputError, match=r"--dtype: dtype 'int8' is a weight-only .* expected one of fp32, bf16, fp16"):
        compute_dtype("int8", None, "--dtype")
    assert compute_dtype("float16").torch_name == "float16"


def test_planner_accepts_an_alias_and_keeps_the_canonical_name():
    from pathlib import Path

    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.model_spec import load_model_spec

    spec = load_model_spec("Llama-2-7B")
    assert spec.weight_bytes("float16") == spec.weight_bytes("fp16")
    lab = load_cluster_profile(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "fragmented_lab.yaml")
    assert CostModel(spec, lab, dtype="bfloat16").dtype == "bf16"
    with pytest.raises(InputError, match="--dtype: dtype: unknown dtype 'fp7'"):
        CostModel(spec, lab, dtype="fp7")


def test_gears_keep_a_canonical_dtype_and_refuse_unknown_ones():
    from pydantic import ValidationError

    from flexpipe_dag.core.gear_builders import manual_gear

    gear = manual_gear([2, 2])
    assert gear.model_copy(update={"dtype": "bf16"}).dtype == "bf16"
    assert type(gear).model_validate({**gear.model_dump(), "dtype": "float16"}).dtype == "fp16"
    for bad in ("bogus", "", "FP32"):
        with pytest.raises(ValidationError, match="unknown dtype"):
            type(gear).model_validate({**gear.model_dump(), "dtype": bad})


def test_cli_dtype_flags_take_aliases_and_refuse_weight_only_formats_for_the_runtime(capsys):
    from flexpipe_dag.cli import main
    from tests.support import EXAMPLES

    assert main(["plan", "--cluster", str(EXAMPLES / "fragmented_lab.yaml"), "--model", "Llama-3-8B",
                 "--dtype", "float16", "--requests", "60", "--json"]) == 0
    assert '"dtype": "fp16"' in capsys.readouterr().out
    assert main(["run", "--stages", "2", "--num-requests", "1", "--trace", "azure-conv", "--dtype", "int8"]) == 2
    assert "--dtype: dtype 'int8' is a weight-only planning format" in capsys.readouterr().err
