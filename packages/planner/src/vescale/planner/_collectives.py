"""How long a collective takes on the links its mesh axis spans (ring algorithms, alpha-beta).

Ranks are laid out in the canonical mesh order (``pp``, ``dp``, ``ep``, ``tp``: ``tp`` innermost),
so an axis of size ``n`` whose ranks are ``stride`` apart spans ``n * stride`` consecutive ranks;
it stays inside a node when those fit in one, and otherwise its ring crosses nodes through each
node's ``k`` members' own adapters (bandwidth ``min(intra, k * inter)`` per device, as NCCL's
rings use one adapter each).

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
]


@dataclass(frozen=True)
class AxisLink:
    """One mesh axis: its size, bandwidth per device (bytes/s), latency per ring step, and whether
    it crosses nodes."""

    size: int
    bandwidth: float
    latency: float
    crosses_nodes: bool
    reduce_scatter_is_all_reduce: bool = False
    """The backend runs a reduce-scatter as a whole all-reduce (gloo has no reduce-scatter of its own)."""


def axis_link(
    hardware: HardwareProfile, size: int, stride: int, devices_per_node: int | None = None
) -> AxisLink:
    """The link of an axis of ``size`` ranks, ``stride`` ranks apart (module docstring).

    Example::

        axis_link(load_hardware("h100-80gb"), size=8, stride=1).crosses_nodes   # False
    """
    per_node = devices_per_node or hardware.devices_per_node
    crosses = size * stride > per_node and size > 1
    via_all_reduce = hardware.reduce_scatter_is_all_reduce
    if not crosses:
        return AxisLink(
            size, hardware.link_bandwidth(False), hardware.link_latency(False), False, via_all_reduce
        )
    members_per_node = max(1, min(size, per_node // stride))
    bandwidth = min(hardware.link_bandwidth(False), members_per_node * hardware.link_bandwidth(True))
    return AxisLink(size, bandwidth, hardware.link_latency(True), True, via_all_reduce)


def all_reduce_seconds(link: AxisLink, nbytes: float) -> float:
    """Ring all-reduce of ``nbytes`` per rank: ``2 (n-1) alpha + 2 (n-1)/n * bytes / beta``."""
    n = link.size
    if n == 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def all_gather_seconds(link: AxisLink, nbytes: float) -> float:
    """Ring all-gather (or reduce-scatter) of a ``nbytes`` result:
    ``(n-1) alpha + (n-1)/n * bytes / beta``."""
    n = link.size
    if n == 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def reduce_scatter_seconds(link: AxisLink, nbytes: float) -> float:
    """Reduce-scatter of ``nbytes`` per rank into ``1/n`` each: as :func:`all_gather_seconds` on a
    ring, or a whole all-reduce where the backend has no reduce-scatter (gloo)."""
    if link.reduce_scatter_is_all_reduce:
        return all_reduce_seconds(link, nbytes)
    return all_gather_seconds(link, nbytes)


def all_to_all_seconds(link: AxisLink, nbytes: float) -> float:
    """All-to-all of ``nbytes`` per rank, spread evenly: each rank keeps ``1/n`` and exchanges the rest
    with the ``n - 1`` others, ``(n-1) alpha + (n-1)/n * bytes / beta``."""
    n = link.size
    if n == 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def p2p_seconds(link: AxisLink, nbytes: float) -> float:
    """One send of ``nbytes`` to the neighbouring stage."""
    if link.size == 1 or nbytes <= 0:
        return 0.0
    return link.latency + nbytes / link.bandwidth
