"""How long a collective takes on the links its mesh axis spans (ring algorithms, alpha-beta).

Ranks are laid out in the canonical mesh order (``pp``, ``dp``, ``ep``, ``tp``: ``tp`` innermost),
so an axis of size ``n`` whose ranks are ``stride`` apart spans ``n * stride`` consecutive ranks;
it stays inside a node when those fit in one, and otherwise its ring crosses nodes through each
node's ``k`` members' own adapters (bandwidth ``min(intra, k * inter)`` per device, as NCCL's
rings use one adapter each). Each collective also waits once for its last member
(``collective_wait_us``: 0 on devices of their own; a scheduler time slice where CPU ranks
outnumber the cores).

Example::

    link = axis_link(hardware, size=8, stride=8)       # dp over 8 nodes, one member per node
    all_reduce_seconds(link, 2e9)
"""

from __future__ import annotations

from dataclasses import dataclass

from vescale.planner.hardware import HardwareProfile

__all__ = [
    "AxisLink",
    "all_gather_seconds",
    "all_reduce_seconds",
    "all_to_all_seconds",
    "axis_link",
    "p2p_seconds",
    "reduce_scatter_seconds",
    "zero_publish_seconds",
]


@dataclass(frozen=True)
class AxisLink:
    """One mesh axis: its size, bandwidth per device (bytes/s), latency per ring step, and whether
    it crosses nodes."""

    size: int
    bandwidth: float
    latency: float
    crosses_nodes: bool
    gather_factor: float = 1.0
    """The backend's all-gather time over a ring all-gather's (1 for NCCL; measured for gloo)."""
    scatter_factor: float = 1.0
    """The backend's reduce-scatter time over a ring reduce-scatter's (1 for NCCL; gloo: 3-4.6)."""
    wait: float = 0.0
    """Seconds each collective waits for its last member (ranks sharing cores; 0 on devices)."""
    publish_factor: float = 1.0
    """ZeRO-1/2's parameter publish over a ring all-gather's (1 for NCCL; gloo broadcasts)."""


def _wait_seconds(hardware: HardwareProfile, size: int) -> float:
    """The wait of a collective of ``size`` ranks for its last member: arrivals spread evenly over
    a time slice put the last of ``n`` ``(n - 1) / (2 (n + 1))`` of a slice after their mean,
    scaled from ``collective_wait_us``, measured with every rank of a node in the collective
    (8 ranks on 2 cores measured 1-2.4 ms for pairs, 3.9 for fours, 3.8-5.1 for all eight)."""

    def spread(n: int) -> float:
        return (n - 1) / (n + 1)

    return hardware.collective_wait_us * 1e-6 * spread(size) / spread(max(hardware.devices_per_node, 2))


def axis_link(
    hardware: HardwareProfile, size: int, stride: int, devices_per_node: int | None = None
) -> AxisLink:
    """The link of an axis of ``size`` ranks, ``stride`` ranks apart (module docstring).

    Example::

        axis_link(load_hardware("h100-80gb"), size=8, stride=1).crosses_nodes   # False
    """
    per_node = devices_per_node or hardware.devices_per_node
    crosses = size * stride > per_node and size > 1
    backend = (
        hardware.all_gather_factor,
        hardware.reduce_scatter_factor,
        _wait_seconds(hardware, size),
        hardware.zero_publish_factor,
    )
    if not crosses:
        return AxisLink(size, hardware.link_bandwidth(False), hardware.link_latency(False), False, *backend)
    members_per_node = max(1, min(size, per_node // stride))
    bandwidth = min(hardware.link_bandwidth(False), members_per_node * hardware.link_bandwidth(True))
    return AxisLink(size, bandwidth, hardware.link_latency(True), True, *backend)


def all_reduce_seconds(link: AxisLink, nbytes: float) -> float:
    """Ring all-reduce of ``nbytes`` per rank: ``2 (n-1) alpha + 2 (n-1)/n * bytes / beta``."""
    n = link.size
    if n == 1 or nbytes <= 0:
        return 0.0
    return link.wait + 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def _half_ring_seconds(link: AxisLink, nbytes: float, factor: float) -> float:
    n = link.size
    if n == 1 or nbytes <= 0:
        return 0.0
    return link.wait + factor * ((n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth)


def all_gather_seconds(link: AxisLink, nbytes: float) -> float:
    """All-gather of a ``nbytes`` result: ``(n-1) alpha + (n-1)/n * bytes / beta`` on a ring, times
    the backend's measured ``gather_factor``."""
    return _half_ring_seconds(link, nbytes, link.gather_factor)


def zero_publish_seconds(link: AxisLink, nbytes: float) -> float:
    """ZeRO-1/2 publishing ``nbytes`` of stepped parameters to every rank: the ring all-gather's
    time, times the backend's measured ``publish_factor``."""
    return _half_ring_seconds(link, nbytes, link.publish_factor)


def reduce_scatter_seconds(link: AxisLink, nbytes: float) -> float:
    """Reduce-scatter of ``nbytes`` per rank into ``1/n`` each: the ring all-gather's time, times the
    backend's measured ``scatter_factor`` (gloo has no ring reduce-scatter: PyTorch runs a whole
    all-reduce and more)."""
    return _half_ring_seconds(link, nbytes, link.scatter_factor)


def all_to_all_seconds(link: AxisLink, nbytes: float) -> float:
    """All-to-all of ``nbytes`` per rank, spread evenly: each rank keeps ``1/n`` and exchanges the rest
    with the ``n - 1`` others, ``(n-1) alpha + (n-1)/n * bytes / beta``."""
    n = link.size
    if n == 1 or nbytes <= 0:
        return 0.0
    return link.wait + (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def p2p_seconds(link: AxisLink, nbytes: float) -> float:
    """One send of ``nbytes`` to the neighbouring stage."""
    if link.size == 1 or nbytes <= 0:
        return 0.0
    return link.wait + link.latency + nbytes / link.bandwidth
