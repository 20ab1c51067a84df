"""Cluster profile loading: the three forms, and a clear error for each class of bad input."""

from __future__ import annotations

import copy

import pytest
import yaml

from flexpipe_dag.core.cluster import ClusterProfile, load_cluster_profile, parse_cluster_profile
from flexpipe_dag.core.errors import InputError
from tests.support import EXAMPLES


def seed_doc() -> dict:
    return yaml.safe_load((EXAMPLES / "seed_example.yaml").read_text())


def test_seed_form_loads_as_is():
    p = load_cluster_profile(EXAMPLES / "seed_example.yaml")
    assert [d.device_id for d in p.devices] == ["gpu_001", "gpu_002", "gpu_003", "gpu_004"]
    t4 = p.device("gpu_003")
    assert (t4.model_name, t4.memory_gib, t4.max_micro_batch) == ("T4", 15.0, 8)  # driver-visible, not the label
    assert t4.peak_tflops == pytest.approx(0.21 * 312)
    assert t4.hbm_bandwidth_gbps == 320.0  # from the datasheet table
    assert p.link("gpu_003", "gpu_004").bandwidth_gbps == 16
    assert p.link("gpu_004", "gpu_001") is None


def test_fleet_form_derives_links_from_datasheets():
    p = load_cluster_profile(EXAMPLES / "fragmented_lab.yaml")
    assert len(p.devices) == 7 and p.links == [] and len(p.topology.hosts) == 4  # pairs derived, not stored
    ids = [d.device_id for d in p.devices]
    assert all(p.link(a, b) is not None for a in ids for b in ids if a != b)
    assert p.link("host-a100-gpu0", "host-a100-gpu1").bandwidth_gbps == 300  # NVLink
    assert p.link("host-t4-gpu0", "host-t4-gpu1").kind == "pcie"
    assert p.link("host-a100-gpu0", "host-t4-gpu0").bandwidth_gbps == 12.5  # across hosts


def test_native_form_round_trips():
    p = load_cluster_profile(EXAMPLES / "alibaba_openb.yaml")
    assert parse_cluster_profile(p.to_dict()) == p


def _mutate(fn):
    doc = seed_doc()
    fn(doc)
    return doc


BAD_SEEDS = {
    "zero memory": (lambda d: d["nodes"][1].update(memory_gb=0), "nodes[1].memory_gb"),
    "negative memory": (lambda d: d["nodes"][2].update(memory_gb=-16), "nodes[2].memory_gb"),
    "NaN compute": (lambda d: d["nodes"][0].update(compute_score=float("nan")), "nodes[0].compute_score"),
    "missing field": (lambda d: d["nodes"][3].pop("memory_gb"), "nodes[3].memory_gb"),
    "unknown peer": (lambda d: d["nodes"][0]["interconnect"].update(to_gpu_999={"bandwidth_gbps": 1, "latency_us": 1}),
                     "nodes[0].interconnect.to_gpu_999"),
    "self link": (lambda d: d["nodes"][0]["interconnect"].update(to_gpu_001={"bandwidth_gbps": 1, "latency_us": 1}),
                  "nodes[0].interconnect.to_gpu_001"),
    "duplicate id": (lambda d: d["nodes"][1].update(node_id="gpu_001"), "nodes[1].node_id"),
    "negative bandwidth": (lambda d: d["nodes"][0]["interconnect"]["to_gpu_002"].update(bandwidth_gbps=-3),
                           "nodes[0].interconnect.to_gpu_002.bandwidth_gbps"),
    "unknown field": (lambda d: d["nodes"][0].update(memroy_gb=3), "nodes[0].memroy_gb"),
    # a number is no date-time (pydantic would read it as seconds since 1970: a device gone in 1970)
    "numeric available_until": (lambda d: d["nodes"][2].update(available_until=12345), "nodes[2].available_until"),
    "boolean available_until": (lambda d: d["nodes"][2].update(available_until=True), "nodes[2].available_until"),
    # a string or a number is no boolean (pydantic's lax mode read "yes", "off", 0 and 1 as bf16 True / False)
    "string bf16": (lambda d: d["nodes"][0].update(bf16="yes"), "nodes[0].bf16"),
    "numeric bf16": (lambda d: d["nodes"][1].update(bf16=0), "nodes[1].bf16"),
    # the name looked up is model_name when given: it is named, not the valid generation beside it
    "unknown model_name": (lambda d: (d["nodes"][0].pop("compute_score"), d["nodes"][0].update(model_name="Foo")),
                           "nodes[0].model_name"),
    "unknown generation": (lambda d: (d["nodes"][0].pop("compute_score"), d["nodes"][0].update(generation="Z9")),
                           "nodes[0].generation"),
    "no name at all": (lambda d: (d["nodes"][0].pop("compute_score"), d["nodes"][0].pop("generation")),
                       "nodes[0].generation"),
}


@pytest.mark.parametrize("case", list(BAD_SEEDS))
def test_bad_seed_input_names_file_and_field(case, tmp_path):
    mutate, field = BAD_SEEDS[case]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_mutate(mutate)))
    with pytest.raises(InputError) as err:
        load_cluster_profile(path)
    assert err.value.source == str(path)
    assert err.value.field == field, str(err.value)


def test_native_form_errors_name_the_field():
    doc = load_cluster_profile(EXAMPLES / "seed_example.yaml").to_dict()
    bad = copy.deepcopy(doc)
    bad["links"][0]["dst_device_id"] = "nope"
    with pytest.raises(InputError, match=r"links\[0\]\.dst_device_id: unknown device 'nope'"):
        parse_cluster_profile(bad, "x.json")
    bad = copy.deepcopy(doc)
    bad["devices"][1]["device_id"] = "gpu_001"
    with pytest.raises(InputError, match=r"devices\[1\]\.device_id: duplicate"):
        parse_cluster_profile(bad, "x.json")
    bad = copy.deepcopy(doc)
    bad["links"][0]["dst_device_id"] = bad["links"][0]["src_device_id"]
    with pytest.raises(InputError, match="self-link"):
        parse_cluster_profile(bad, "x.json")
    for text in ("yes", "off", 1):  # bf16 must be a boolean, not a string or number read as one
        bad = copy.deepcopy(doc)
        bad["devices"][0]["bf16"] = text
        with pytest.raises(InputError, match=r"devices\[0\]\.bf16: Input should be a valid boolean"):
            parse_cluster_profile(bad, "x.json")


def test_unreadable_and_unparsable_files(tmp_path):
    with pytest.raises(InputError, match="cannot read file"):
        load_cluster_profile(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("nodes: [\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_cluster_profile(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(InputError, match="expected a mapping"):
        load_cluster_profile(tmp_path / "list.yaml")
    (tmp_path / "fleet.yaml").write_text("cluster_id: x\nfleet: [{node_id: a, gpu_model: Z9000}]\n")
    with pytest.raises(InputError, match=r"fleet\[0\]\.gpu_model: unknown GPU model 'Z9000'"):
        load_cluster_profile(tmp_path / "fleet.yaml")


def test_available_until_models_time_fragments():
    import datetime as dt

    p = ClusterProfile.model_validate({
        "cluster_id": "c", "devices": [{"device_id": "a", "node_id": "n", "memory_gib": 16, "peak_tflops": 65,
                                        "hbm_bandwidth_gbps": 320, "compute_score": 0.2,
                                        "available_until": "2026-12-01T00:00:00Z"}]})
    now = dt.datetime(2026, 11, 30, 23, 0, tzinfo=dt.UTC)
    assert p.devices[0].available_for_s(now) == 3600


@pytest.mark.parametrize("where, field", [
    ({"notes": ["\x1b[31mred\x1b[0m"]}, "notes[0]"),
    ({"fleet": [{"node_id": "a", "gpu_model": "T4", "count": 1}], "notes": ["ok", "\u202eevil"]}, "notes[1]"),
])
def test_terminal_escapes_in_fleet_notes_are_refused(where, field, tmp_path):
    # notes are printed as they are by `flexpipe profile`: an ESC sequence recoloured the terminal / set its title
    doc = {"cluster_id": "t", "fleet": [{"node_id": "a", "gpu_model": "T4", "count": 1}], **where}
    with pytest.raises(InputError) as err:
        parse_cluster_profile(doc, "c.yaml")
    assert err.value.field == field and "expected printable text" in err.value.problem


@pytest.mark.parametrize("key", ["model_name", "generation"])
def test_terminal_escapes_in_native_device_text_are_refused(key):
    doc = load_cluster_profile(EXAMPLES / "seed_example.yaml").to_dict()
    doc["devices"][0][key] = "A100\x1b]0;pwned\x07"
    with pytest.raises(InputError) as err:
        parse_cluster_profile(doc, "c.json")
    assert err.value.field == f"devices[0].{key}" and "expected printable text" in err.value.problem
    doc["devices"][0][key] = "NVIDIA A100-SXM4-80GB"  # spaces and the usual NVML names stay accepted
    assert parse_cluster_profile(doc, "c.json").devices[0].model_name


@pytest.mark.parametrize("doc, field", [
    ({"cluster_id": "t", "fleet": [None]}, "fleet[0]"),
    ({"cluster_id": "t", "fleet": [["a", "T4"]]}, "fleet[0]"),
    ({"nodes": [{"node_id": "g", "generation": "A100", "memory_gb": 80, "interconnect": {"to_h": 5}}]},
     "nodes[0].interconnect.to_h"),
])
def test_an_entry_that_is_not_a_mapping_is_not_named_by_our_class(doc, field):
    # pydantic said "Input should be a valid dictionary or instance of _FleetNode": a private class, not the file's
    with pytest.raises(InputError) as err:
        parse_cluster_profile(doc, "c.yaml")
    assert err.value.field == field and "instance of" not in err.value.problem and "_" not in err.value.problem
    assert err.value.problem.startswith("Input should be a valid dictionary (a mapping of fields)")


def test_a_profile_mixing_two_forms_says_so(tmp_path):
    path = tmp_path / "mixed.yaml"
    path.write_text("cluster_id: x\nfleet:\n  - {node_id: a, gpu_model: T4}\nnodes:\n  - {node_id: b, memory_gb: 16}\n")
    with pytest.raises(InputError, match="holds 'nodes' and 'fleet'; expected one form of profile"):
        load_cluster_profile(path)
