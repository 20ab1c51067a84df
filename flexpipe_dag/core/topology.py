"""Network topology of a cluster: hosts, racks and tiers, from which any device pair's link is derived.

A fleet of thousands of GPUs is described by its hosts and its network, not by every pair of devices
(a million rows at 1,000 GPUs). A :class:`Topology` holds:

* one :class:`Host` per host: its rack (``rack_id``, optional) and how its own devices talk
  (``intra_kind`` NVLink / PCIe, ``intra_bandwidth_gbps``, ``intra_latency_us``);
* the network tiers between hosts (:class:`NetworkTier`): ``inter_node`` between two hosts of one rack
  (under one top-of-rack switch; between any two hosts when no racks are named) and ``inter_rack``
  between hosts of different racks (through the spine), each with its per-host figures and the
  tier's ``oversubscription`` (a 3:1 spine gives each host a third of its NIC's bandwidth when all
  hosts send at once).

The link ``a -> b`` of two devices is then (:meth:`Topology.pair_tier`, :meth:`Topology.derived_link`):

=========================  =====================================  ==================  =========
devices                    bandwidth_gbps                         latency_us          kind
=========================  =====================================  ==================  =========
on one host                ``intra_bandwidth_gbps`` of that host  ``intra_latency_us``  ``intra_kind``
hosts of one rack          ``inter_node.bandwidth_gbps / o``      ``inter_node.latency_us``  ``network``
hosts of different racks   ``inter_rack.bandwidth_gbps / o``      ``inter_rack.latency_us``  ``inter-rack``
=========================  =====================================  ==================  =========

with ``o`` the tier's oversubscription (1 = non-blocking). Without ``inter_rack``, hosts of different
racks use ``inter_node``. Measured pairs are held by the cluster profile as overrides
(:meth:`flexpipe_dag.core.cluster.ClusterProfile.link`), so storage grows with hosts and devices,
never with their pairs.

Units: GB/s (10^9 bytes per second, one direction), microseconds.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, model_validator

from flexpipe_dag.core.ids import Identifier, PrintableText

#: Highest bandwidth a link or a tier may declare, GB/s (a B200's HBM is 8,000).
MAX_BANDWIDTH_GBPS = 100_000.0
#: Highest link latency, microseconds (10 s).
MAX_LATENCY_US = 1e7
#: Highest oversubscription of a tier (bandwidth shared by this many hosts' worth of traffic).
MAX_OVERSUBSCRIPTION = 1000.0
#: Most hosts one topology may hold (one device per host at the cluster's device limit).
MAX_HOSTS = 32_768

Gbps = Annotated[float, Strict(), Field(gt=0, le=MAX_BANDWIDTH_GBPS, allow_inf_nan=False)]
LatencyUs = Annotated[float, Strict(), Field(ge=0, le=MAX_LATENCY_US, allow_inf_nan=False)]
Oversubscription = Annotated[float, Strict(), Field(ge=1.0, le=MAX_OVERSUBSCRIPTION, allow_inf_nan=False)]
#: Which figures a device pair takes: same host, same rack, or across racks.
PairTier = Literal["intra", "inter_node", "inter_rack"]
#: Link kinds of derived pairs across hosts.
NETWORK_KIND = "network"
INTER_RACK_KIND = "inter-rack"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class FieldsEqual(BaseModel):
    """A model whose private attributes are lookup caches: equal when its fields are (pydantic's own
    ``==`` also compares private attributes, so a profile that was asked for a link would differ from
    its copy that was not)."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__


class NetworkTier(_Strict):
    """Per-host figures of one network tier between hosts."""

    bandwidth_gbps: Gbps = Field(description="GB/s one host can send through this tier, one direction (its NIC)")
    latency_us: LatencyUs = Field(description="one-way small-message latency across the tier, microseconds")
    oversubscription: Oversubscription = Field(
        1.0, description="ratio of host bandwidth to the tier's uplink bandwidth (1 = non-blocking, 3 = 3:1)")

    @property
    def effective_bandwidth_gbps(self) -> float:
        """Bandwidth a pair of hosts gets through this tier with every host sending, GB/s:
        ``bandwidth_gbps / oversubscription``."""
        return self.bandwidth_gbps / self.oversubscription


class Host(_Strict):
    """One host: its rack and how the devices it holds talk to each other."""

    host_id: Identifier
    rack_id: Identifier | None = Field(None, description="rack (top-of-rack switch) of the host; None = the one default rack")
    intra_kind: PrintableText = Field("pcie", max_length=40, description="how the host's devices talk: nvlink, pcie, ...")
    intra_bandwidth_gbps: Gbps = Field(description="GB/s between two devices of this host, one direction")
    intra_latency_us: LatencyUs = Field(description="latency between two devices of this host, microseconds")


class Topology(_Strict, FieldsEqual):
    """Hosts and the network tiers between them (module docstring: how pairs are derived)."""

    hosts: list[Host] = Field(min_length=1, max_length=MAX_HOSTS)
    inter_node: NetworkTier = Field(description="between two hosts of one rack (any two hosts when no racks are named)")
    inter_rack: NetworkTier | None = Field(None, description="between hosts of different racks; None = inter_node")
    _by_id: dict[str, Host] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _unique_hosts(self) -> Topology:
        by_id: dict[str, Host] = {}
        for i, h in enumerate(self.hosts):
            if h.host_id in by_id:
                raise ValueError(f"hosts[{i}].host_id: duplicate host id {h.host_id!r}")
            by_id[h.host_id] = h
        self._by_id = by_id
        return self

    def host(self, host_id: str) -> Host:
        """The host with this id; ``KeyError`` if the topology has none."""
        if len(self._by_id) != len(self.hosts):  # the hosts list was changed in place
            self._by_id = {h.host_id: h for h in self.hosts}
        return self._by_id[host_id]

    def pair_tier(self, src_host_id: str, dst_host_id: str) -> PairTier:
        """Which figures a pair of devices on these hosts takes: ``intra``, ``inter_node`` or ``inter_rack``.

        Raises:
            KeyError: a host the topology does not name.
        """
        if src_host_id == dst_host_id:
            self.host(src_host_id)
            return "intra"
        if self.host(src_host_id).rack_id == self.host(dst_host_id).rack_id:
            return "inter_node"
        return "inter_rack"

    def pair_figures(self, src_host_id: str, dst_host_id: str) -> tuple[float, float, str]:
        """``(bandwidth_gbps, latency_us, kind)`` of a device on ``src_host_id`` sending to one on
        ``dst_host_id`` (the table in the module docstring; GB/s one direction, microseconds).

        Raises:
            KeyError: a host the topology does not name.
        """
        tier = self.pair_tier(src_host_id, dst_host_id)
        if tier == "intra":
            h = self.host(src_host_id)
            return h.intra_bandwidth_gbps, h.intra_latency_us, h.intra_kind
        if tier == "inter_node" or self.inter_rack is None:
            return self.inter_node.effective_bandwidth_gbps, self.inter_node.latency_us, NETWORK_KIND
        return self.inter_rack.effective_bandwidth_gbps, self.inter_rack.latency_us, INTER_RACK_KIND

    def tiers(self) -> list[NetworkTier]:
        """The network tiers between hosts (``inter_node``, then ``inter_rack`` when given)."""
        return [self.inter_node] + ([self.inter_rack] if self.inter_rack is not None else [])

    def position_key(self, host_id: str) -> tuple[object, ...]:
        """What makes a device's place in the network alike another's: its host's intra-host figures.

        Devices of equal device profile on hosts of equal key, in racks under the same tiers, see the
        same figures to every other class of device (the rack is not part of the key: racks are
        alike, and the planner fills them one by one).
        """
        h = self.host(host_id)
        return (h.intra_kind, h.intra_bandwidth_gbps, h.intra_latency_us)

    def subset(self, host_ids: set[str]) -> Topology:
        """The topology cut down to ``host_ids`` (tiers kept).

        Raises:
            ValueError: ``host_ids`` names no host of the topology.
        """
        hosts = [h for h in self.hosts if h.host_id in host_ids]
        if not hosts:
            raise ValueError(f"none of {sorted(host_ids)[:5]} is a host of the topology")
        return Topology(hosts=hosts, inter_node=self.inter_node, inter_rack=self.inter_rack)
