"""Topology, not pairs: fleet-form hosts, racks and tiers; derived pairs; overrides; linear storage;
the old forms unchanged; planning by device classes equal to the per-device search."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from flexpipe_dag.core.catalog import gpu_catalog
from flexpipe_dag.core.cluster import INTRA_NODE_LATENCY_US, load_cluster_profile, parse_cluster_profile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.cost_model import CostModel
from flexpipe_dag.planner.gears import candidate_plans, choose_operating_plans, make_search, plan_gear_set
from flexpipe_dag.planner.instances import random_model
from flexpipe_dag.planner.search import MAX_REPLICA_ROUNDS, PipelineSearch
from flexpipe_dag.planner.workload import PlanWorkload
from flexpipe_dag.sql import models as m
from tests.support import EXAMPLES

SMALL = PlanWorkload(context_p95_tokens=2048, concurrency=16, prompt_tokens_mean=512, output_tokens_mean=128,
                     micro_batch_size_candidates=(1, 4, 16))


def racked_fleet(hosts: int = 4, **extra: object) -> dict:
    """A100 hosts of 2 in racks of 2, one T4 host, a 4:1 spine."""
    return {"cluster_id": "racked",
            "fleet": [{"node_id": "a100", "gpu_model": "A100-SXM-80GB", "count": 2, "hosts": hosts, "hosts_per_rack": 2},
                      {"node_id": "t4", "gpu_model": "T4", "count": 2, "rack": "t4-rack"}],
            "inter_node": {"bandwidth_gbps": 25.0, "latency_us": 10.0},
            "inter_rack": {"bandwidth_gbps": 20.0, "latency_us": 30.0, "oversubscription": 4.0}, **extra}


def _figures(profile, src: str, dst: str) -> tuple[float, float, str]:
    link = profile.link(src, dst)
    assert link is not None
    return link.bandwidth_gbps, link.latency_us, link.kind


def test_pairs_are_derived_from_hosts_racks_and_tiers():
    p = parse_cluster_profile(racked_fleet(), "racked")
    assert [h.host_id for h in p.topology.hosts] == ["a100-0", "a100-1", "a100-2", "a100-3", "t4"]
    assert [h.rack_id for h in p.topology.hosts] == ["a100-r0", "a100-r0", "a100-r1", "a100-r1", "t4-rack"]
    assert p.links == []
    # hand-computed: NVLink inside an A100 host (datasheet 300 GB/s, 3 us); PCIe inside the T4 host (16 GB/s, 10 us)
    assert _figures(p, "a100-0-gpu0", "a100-0-gpu1") == (300.0, 3.0, "nvlink")
    assert _figures(p, "t4-gpu1", "t4-gpu0") == (gpu_catalog()["T4"].pcie_gbps, INTRA_NODE_LATENCY_US["pcie"], "pcie")
    assert gpu_catalog()["T4"].pcie_gbps == 16.0
    # hosts of one rack: the inter_node tier as given; across racks: 20 GB/s / 4 = 5 GB/s, 30 us
    assert _figures(p, "a100-0-gpu1", "a100-1-gpu0") == (25.0, 10.0, "network")
    assert _figures(p, "a100-1-gpu0", "a100-2-gpu0") == (5.0, 30.0, "inter-rack")
    assert _figures(p, "t4-gpu0", "a100-3-gpu1") == (5.0, 30.0, "inter-rack")
    assert p.link("t4-gpu0", "t4-gpu0") is None and p.link("t4-gpu0", "nope") is None
    assert p.min_bandwidth_gbps() == 5.0


def test_without_inter_rack_every_host_pair_takes_inter_node():
    doc = racked_fleet()
    del doc["inter_rack"]
    p = parse_cluster_profile(doc, "racked")
    assert _figures(p, "a100-1-gpu0", "a100-2-gpu0") == (25.0, 10.0, "network")


def test_measured_pairs_override_the_derived_ones_in_one_direction():
    doc = racked_fleet(links=[{"src_device_id": "a100-0-gpu0", "dst_device_id": "a100-0-gpu1",
                               "bandwidth_gbps": 120.0, "latency_us": 7.5, "kind": "measured"}])
    p = parse_cluster_profile(doc, "racked")
    assert _figures(p, "a100-0-gpu0", "a100-0-gpu1") == (120.0, 7.5, "measured")
    assert _figures(p, "a100-0-gpu1", "a100-0-gpu0") == (300.0, 3.0, "nvlink")  # the other direction: derived
    assert p.min_bandwidth_gbps() == 5.0
    # the shipped 1,024-GPU example carries one such override
    fleet = load_cluster_profile(EXAMPLES / "fleet_1k.yaml")
    assert len(fleet.devices) == 1024 and len(fleet.topology.hosts) == 128 and len(fleet.links) == 1
    assert _figures(fleet, "a100-00-gpu0", "a100-01-gpu0") == (6.1, 31.0, "declared")
    assert _figures(fleet, "a100-00-gpu0", "a100-16-gpu0") == pytest.approx((12.5 / 3, 40.0, "inter-rack"))


def test_old_fleet_form_gives_the_pairs_it_always_gave():
    """fragmented_lab.yaml used to store n (n - 1) links: same host -> NVLink / PCIe datasheet figure, else inter_node."""
    p = load_cluster_profile(EXAMPLES / "fragmented_lab.yaml")
    catalog = gpu_catalog()
    for a in p.devices:
        for b in p.devices:
            if a is b:
                continue
            if a.node_id == b.node_id:
                spec = catalog[a.model_name]
                kind = "nvlink" if spec.nvlink_gbps else "pcie"
                want = (spec.nvlink_gbps or spec.pcie_gbps, INTRA_NODE_LATENCY_US[kind], kind)
            else:
                want = (12.5, 25.0, "network")
            assert _figures(p, a.device_id, b.device_id) == want, (a.device_id, b.device_id)


def test_seed_and_native_forms_keep_their_explicit_links():
    seed = load_cluster_profile(EXAMPLES / "seed_example.yaml")
    assert seed.topology is None and len(seed.links) == 8
    assert _figures(seed, "gpu_001", "gpu_003") == (12.5, 25.0, "declared")
    assert seed.link("gpu_004", "gpu_001") is None  # not declared, nothing derived
    assert parse_cluster_profile(seed.to_dict()) == seed
    fleet = parse_cluster_profile(racked_fleet(), "racked")
    back = parse_cluster_profile(fleet.to_dict(), "native")
    assert back == fleet and back.topology == fleet.topology


def test_profile_rows_grow_linearly_with_devices(store):
    counts = []
    for hosts in (8, 32):
        profile = parse_cluster_profile(racked_fleet(hosts), "racked")
        info = store.save_profile(profile)
        with store.session() as s:
            counts.append({t.__tablename__: s.scalar(select(func.count()).select_from(t).where(
                t.profile_version_id == info.id)) for t in (m.DeviceRow, m.HostRow, m.NetworkTierRow, m.LinkRow)})
        back = store.load_profile(info.id)
        assert back.devices == profile.devices and back.topology == profile.topology and back.links == []
    assert counts == [{"devices": 18, "hosts": 9, "network_tiers": 2, "links": 0},
                      {"devices": 66, "hosts": 33, "network_tiers": 2, "links": 0}]


def test_a_failed_save_leaves_no_partial_rows(store, monkeypatch):
    import flexpipe_dag.sql.profiles as profiles

    def broken(*_args: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(profiles, "_topology_rows", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        store.save_profile(parse_cluster_profile(racked_fleet(), "racked"))
    assert store.list_profile_versions() == []
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(m.DeviceRow)) == 0


BAD_FLEETS = {
    "more hosts per rack than hosts": (lambda d: d["fleet"][0].update(hosts_per_rack=9), "fleet[0].hosts_per_rack",
                                       "9 hosts per rack for 4 host(s)"),
    "host made twice": (lambda d: d["fleet"][1].update(node_id="a100-1"), "fleet[1].node_id",
                        "duplicate host id 'a100-1'"),
    "oversubscription below 1": (lambda d: d["inter_rack"].update(oversubscription=0.5), "inter_rack.oversubscription",
                                 "greater than or equal to 1"),
    "zero hosts": (lambda d: d["fleet"][0].update(hosts=0), "fleet[0].hosts", "greater than or equal to 1"),
    "hosts as text": (lambda d: d["fleet"][0].update(hosts="4"), "fleet[0].hosts", "integer"),
    "override to an unknown device": (
        lambda d: d.update(links=[{"src_device_id": "a100-0-gpu0", "dst_device_id": "a100-9-gpu0",
                                   "bandwidth_gbps": 1.0, "latency_us": 1.0}]),
        "links[0].dst_device_id", "unknown device 'a100-9-gpu0'"),
    "negative tier bandwidth": (lambda d: d["inter_node"].update(bandwidth_gbps=-1.0), "inter_node.bandwidth_gbps",
                                "greater than 0"),
    "unknown tier field": (lambda d: d["inter_rack"].update(oversubscribed=2), "inter_rack.oversubscribed", "extra"),
}


@pytest.mark.parametrize("case", list(BAD_FLEETS))
def test_bad_topology_input_names_file_field_and_expected(case):
    mutate, field, expected = BAD_FLEETS[case]
    doc = racked_fleet()
    mutate(doc)
    with pytest.raises(InputError) as err:
        parse_cluster_profile(doc, "fleet.yaml")
    text = str(err.value)
    assert "fleet.yaml" in text and field in text and expected.lower() in text.lower(), text


def test_native_form_device_on_a_host_the_topology_lacks_is_refused():
    doc = parse_cluster_profile(racked_fleet(), "racked").to_dict()
    doc["devices"][3]["node_id"] = "elsewhere"
    with pytest.raises(InputError, match=r"devices\[3\]\.node_id: .*host 'elsewhere' is not in topology\.hosts"):
        parse_cluster_profile(doc, "native.json")


# -- planning by classes ------------------------------------------------------------------------------
def _shape(search: PipelineSearch, scored) -> tuple[object, ...]:
    """What a plan is, up to renaming interchangeable devices: stage device models, replicas, layers, figures."""
    plan, est = scored.plan, scored.estimate
    models = tuple((search.cm.device(ds[0]).model_name, len(ds)) for ds in plan.device_ids)
    return (plan.micro_batch_size, models, tuple(plan.sizes), round(est.tokens_per_s, 6), round(est.tpot_idle_ms, 6))


def test_small_fleets_plan_every_device_and_large_ones_their_classes():
    import numpy as np

    model = random_model(np.random.default_rng(3), 80)
    for name in ("fragmented_lab.yaml", "alibaba_openb.yaml"):
        search = make_search(load_cluster_profile(EXAMPLES / name), model, workload=SMALL)
        assert [d.device_id for d in search.pool] == [d.device_id for d in search.usable]
    search = make_search(load_cluster_profile(EXAMPLES / "fleet_1k.yaml"), model, workload=SMALL)
    kept = 80 + MAX_REPLICA_ROUNDS
    # four types of 256 GPUs; the two devices of the measured override are classes of their own
    assert sorted(len(c.device_ids) for c in search.classes) == [1, 1, 254, 256, 256, 256]
    assert all(c.kept == min(len(c.device_ids), kept) for c in search.classes)
    assert len(search.pool) == 2 + 4 * kept
    a100 = [d.device_id for d in search.pool if d.model_name == "A100-SXM-80GB"]
    assert a100[:3] == ["a100-00-gpu0", "a100-00-gpu1", "a100-00-gpu2"]  # hosts filled one by one
    assert any("1024 usable devices planned as 6 classes" in n for n in search.notes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_class_planning_equals_the_per_device_search(seed):
    """A fleet whose classes are larger than the search keeps: the three gears' plans equal the full search's."""
    import numpy as np

    rng = np.random.default_rng(seed)
    model = random_model(rng, int(rng.integers(4, 9)))
    doc = {"cluster_id": "classes",
           "fleet": [{"node_id": "t4", "gpu_model": "T4", "count": 4, "hosts": 20, "hosts_per_rack": 5},
                     {"node_id": "a10", "gpu_model": "A10", "count": 2, "hosts": 40, "hosts_per_rack": 10},
                     {"node_id": "v100", "gpu_model": "V100-SXM2-32GB", "count": 2}],
           "inter_node": {"bandwidth_gbps": 12.5, "latency_us": 25.0},
           "inter_rack": {"bandwidth_gbps": 12.5, "latency_us": 40.0, "oversubscription": 2.0}}
    cluster = parse_cluster_profile(doc, "classes")
    cm = CostModel(model, cluster)
    by_class = PipelineSearch(cm, SMALL)
    per_device = PipelineSearch(cm, SMALL, class_members_max=None)
    assert len(by_class.pool) < len(per_device.pool) == 162
    for replicas in (True, False):
        chosen_c, collapsed_c = choose_operating_plans(by_class, candidate_plans(by_class, replicas=replicas))
        chosen_d, collapsed_d = choose_operating_plans(per_device, candidate_plans(per_device, replicas=replicas))
        assert collapsed_c == collapsed_d
        assert {k: _shape(by_class, v) for k, v in chosen_c.items()} == \
               {k: _shape(per_device, v) for k, v in chosen_d.items()}


def test_fleet_gears_plan_with_classes_and_keep_their_figures():
    """plan_gear_set on 1,024 GPUs gives the same gears as on a fleet with twice the hosts of each class."""
    import numpy as np

    model = random_model(np.random.default_rng(7), 12)

    def fleet(hosts: int) -> dict:
        return {"cluster_id": "fleet", "inter_node": {"bandwidth_gbps": 12.5, "latency_us": 25},
                "inter_rack": {"bandwidth_gbps": 12.5, "latency_us": 40, "oversubscription": 3},
                "fleet": [{"node_id": k.lower(), "gpu_model": k, "count": 8, "hosts": hosts, "hosts_per_rack": 16}
                          for k in ("A100-SXM-80GB", "V100-SXM2-32GB", "A10", "T4")]}

    small = plan_gear_set(parse_cluster_profile(fleet(32), "fleet-1k"), model, workload=SMALL)
    big = plan_gear_set(parse_cluster_profile(fleet(64), "fleet-2k"), model, workload=SMALL)
    assert [(g.kind, g.num_stages, len(g.device_ids), g.estimate.tokens_per_s) for g in small.gears] == \
           [(g.kind, g.num_stages, len(g.device_ids), g.estimate.tokens_per_s) for g in big.gears]


def test_a_calibrated_pair_of_a_topology_becomes_an_override():
    import datetime as dt

    from flexpipe_dag.calibration.calibrate import Calibration
    from flexpipe_dag.calibration.links import LinkFit

    cluster = parse_cluster_profile(racked_fleet(), "racked")
    fit = LinkFit("a100-0-gpu0", "a100-2-gpu1", 5.0, 30.0, 3.5, 55.0, 40, 4, True)
    calibrated = Calibration("racked", "m", "bf16", {}, [fit], dt.datetime.now(dt.UTC), 40).calibrated_cluster(cluster)
    assert _figures(calibrated, "a100-0-gpu0", "a100-2-gpu1") == (3.5, 55.0, "calibrated")
    assert _figures(calibrated, "a100-2-gpu1", "a100-0-gpu0") == (5.0, 30.0, "inter-rack")  # not observed: derived
    assert cluster.links == [] and calibrated.topology == cluster.topology
