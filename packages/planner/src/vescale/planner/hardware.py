"""Hardware profiles: what one device computes and moves per second, for the step-time model.

A :class:`HardwareProfile` holds the published peak dense FLOP/s per dtype, the memory and its
bandwidth, the link bandwidth per device inside a node (NVLink) and across nodes (InfiniBand,
one direction), the devices per node, and a few efficiency figures the cost model
(:mod:`vescale.planner.cost`) applies to them. Built in: ``h100-80gb``, ``h200-141gb``,
``a100-80gb``, ``a100-40gb`` (NVIDIA's data sheets, SXM parts); a user's JSON file (the form
:meth:`HardwareProfile.to_dict` writes); and ``cpu``, measured on the spot by
:func:`calibrate_cpu` (matmuls, copies and gloo all-reduces timed on the ranks at once, as a
training run loads them; :mod:`vescale.planner.calibrate`).

Example::

    profile = load_hardware("h100-80gb")
    profile.peak_flops("bf16")          # 9.89e14
    HardwareProfile.from_dict(profile.to_dict()) == profile
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vescale.planner.calibrate import measure_cpu
from vescale.planner.errors import PlanError

__all__ = ["BUILTIN_PROFILES", "HardwareProfile", "calibrate_cpu", "load_hardware"]

_DTYPE_NAMES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "torch.float16": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "torch.float32": "fp32",
    "tf32": "tf32",
    "fp8": "fp8",
}


_MAY_BE_ZERO = ("optimizer_ops_per_tensor", "redistribute_overhead_us", "collective_wait_us")


@dataclass(frozen=True)
class HardwareProfile:
    """One kind of device and its node (see the module docstring); bandwidths in bytes/s.

    Example::

        h100 = load_hardware("h100-80gb")
        h100.peak_flops("bf16") / 1e12      # 989.4
    """

    name: str
    """A built-in profile's key (``"h100-80gb"``), ``"cpu"``, or a user's own name."""
    peak_tflops: tuple[tuple[str, float], ...]
    """Dense tera-FLOP/s per dtype (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"tf32"``, ``"fp8"``), as
    ``(dtype, tflops)`` pairs sorted by dtype; a dict is accepted."""
    memory_gb: float
    """One device's memory in GiB: the planner's memory budget where no constraint sets one."""
    memory_bandwidth: float
    """Bytes/s between a device's memory and its cores (HBM on a GPU, RAM on the CPU)."""
    intra_node_bandwidth: float
    """Bytes/s per device, one direction, on the links inside a node (NVLink)."""
    inter_node_bandwidth: float
    """Bytes/s per device, one direction, on the links across nodes (InfiniBand)."""
    devices_per_node: int
    """Devices joined by the intra-node links; larger groups cross nodes."""
    intra_node_latency_us: float = 10.0
    """Microseconds per step (one hop of a ring) of a collective inside a node."""
    inter_node_latency_us: float = 20.0
    """Microseconds per step (one hop of a ring) of a collective across nodes."""
    matmul_efficiency: float = 0.75
    """The fraction of peak FLOP/s a large matmul reaches."""
    matmul_half_dim: float = 64.0
    """The smallest matrix dimension at which a matmul reaches half of ``matmul_efficiency``."""
    memory_efficiency: float = 0.8
    """The fraction of ``memory_bandwidth`` a memory-bound op reaches."""
    collective_efficiency: float = 0.8
    """The fraction of link bandwidth a ring collective reaches."""
    op_overhead_us: float = 10.0
    """Host microseconds of one eager op (a small op costs at least that)."""
    matmul_overhead_us: float = 5.0
    """The fixed microseconds of one matmul call."""
    dtensor_op_overhead_us: float = 10.0
    """Host microseconds of one op on DTensors (every op of a tensor-parallel model)."""
    overlaps_communication: bool = True
    """Whether ZeRO-3's prefetched gathers run beside compute (GPU streams: yes; CPU ranks: no)."""
    optimizer_ops_per_tensor: float = 0.0
    """The eager ops AdamW runs per parameter tensor: 0 where its multi-tensor kernels step them all
    at once, as on CUDA; ~12 in its per-tensor loop on CPU. Priced at ``op_overhead_us`` each where
    the profile has no measured ``optimizer_tensor_us``."""
    optimizer_tensor_us: float | None = None
    """Host microseconds AdamW's per-tensor loop spends on one parameter tensor beyond its memory
    traffic, measured (``calibrate_cpu``: a step of many tiny tensors, under ``no_grad`` as the
    optimizer runs, where an op costs a fifth of one autograd records); ``None``:
    ``optimizer_ops_per_tensor * op_overhead_us``."""
    dtensor_optimizer_tensor_us: float | None = None
    """The same for DTensor parameters (ZeRO-3's FSDP2 shards; under ZeRO-0-2 ``vescale.doptim``
    steps plain local tensors, tensor parallel or not); ``None``:
    ``optimizer_ops_per_tensor * dtensor_op_overhead_us``."""
    redistribute_overhead_us: float = 0.0
    """Host microseconds a DTensor redistribution adds to each tensor-parallel collective (its
    planning, copies and autograd wrapping), measured on CPU ranks; 0 where the host runs ahead
    of the device, as on GPUs."""
    collective_wait_us: float = 0.0
    """Microseconds a collective of all ``devices_per_node`` ranks waits for its last member, beyond
    the ring's own steps, where the ranks share cores and reach it a time slice apart (measured on
    CPU ranks that outnumber the cores: 2-4 ms with 4 ranks on 2 cores, 5-8 ms with 8); smaller
    collectives wait less (:mod:`._collectives`); 0 on devices of their own, whose ranks run in step."""
    ranks_per_core: float = 1.0
    """How many ranks share one core (``calibrate_cpu``: the ranks over this machine's cores, where
    they outnumber them); 1 where each rank has a device of its own. A rank idle in a pipeline
    bubble then yields its core to the others instead of leaving it idle."""
    all_gather_factor: float = 1.0
    """The backend's all-gather time over a ring all-gather's on the same links (``(n-1) alpha +
    (n-1)/n * bytes / beta`` with the all-reduce's alpha and beta): 1 for NCCL's rings; measured
    on CPU ranks (gloo, 8 MiB: 1.5-1.7 at 4 ranks, 1.3-1.9 at 8)."""
    reduce_scatter_factor: float = 1.0
    """The same for the reduce-scatter: 1 for NCCL; gloo has no ring reduce-scatter and PyTorch
    runs a whole all-reduce and more for it (8 MiB: 2.8-3.0 at 4 ranks, 3.7-4.6 at 8)."""
    zero_publish_factor: float = 1.0
    """The same for ZeRO-1/2 publishing the stepped parameters, the way ``vescale.doptim`` does on
    this backend: an all-gather on NCCL (1), one in-place broadcast per chunk owner on gloo
    (:data:`vescale.doptim.zero.BROADCAST_BACKENDS`), measured on CPU ranks."""
    attention_efficiency: float | None = None
    """The fraction of peak FLOP/s fused attention reaches at large head dimensions (its FLOPs
    counted as the model counts them: half the scores when causal); ``None``: the matmul curve's
    ``matmul_efficiency``. Measured on CPU, where the fused kernel lags the matmul."""
    attention_half_dim: float | None = None
    """The head dimension at which fused attention reaches half of ``attention_efficiency``;
    ``None``: ``matmul_half_dim``."""
    source: str = ""
    """Where the numbers come from (a data sheet, a calibration run)."""

    def __post_init__(self) -> None:
        peaks = self.peak_tflops.items() if isinstance(self.peak_tflops, dict) else self.peak_tflops
        normalised = []
        for dtype, tflops in peaks:
            if dtype not in _DTYPE_NAMES.values() or not isinstance(tflops, int | float) or tflops <= 0:
                raise PlanError(
                    f"hardware profile {self.name!r}: peak_tflops[{dtype!r}]={tflops!r}; give positive "
                    f"numbers for dtypes among {sorted(set(_DTYPE_NAMES.values()))}"
                )
            normalised.append((dtype, float(tflops)))
        object.__setattr__(self, "peak_tflops", tuple(sorted(normalised)))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            optional = field.type == "float | None"
            if (field.type in ("float", "int") or (optional and value is not None)) and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or value < 0
                or (value == 0 and field.name not in _MAY_BE_ZERO)
            ):
                raise PlanError(
                    f"hardware profile {self.name!r}: {field.name}={value!r} must be a positive number"
                    + (" or null" if optional else "")
                )
        if not isinstance(self.devices_per_node, int):
            raise PlanError(f"hardware profile {self.name!r}: devices_per_node must be an integer")

    def peak_flops(self, dtype: Any = "bf16") -> float:
        """Peak dense FLOP/s for ``dtype`` (``"bf16"``, ``torch.float32``, ...); fp32 without an
        entry of its own falls back to the slowest listed one.

        Example::

            mfu = achieved_flops / load_hardware("a100-80gb").peak_flops("bf16")
        """
        name = _DTYPE_NAMES.get(str(dtype))
        peaks = dict(self.peak_tflops)
        if name is None:
            raise PlanError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPE_NAMES))}")
        if name not in peaks and name in ("bf16", "fp16"):
            name = "bf16" if "bf16" in peaks else "fp16"
        if name not in peaks:
            return min(peaks.values()) * 1e12
        return peaks[name] * 1e12

    def attention_curve(self) -> tuple[float, float]:
        """``(efficiency, half_dim)`` of fused attention's curve over the head dimension.

        Example::

            efficiency, half_dim = load_hardware("h100-80gb").attention_curve()   # (0.75, 64.0)
        """
        efficiency = (
            self.matmul_efficiency if self.attention_efficiency is None else self.attention_efficiency
        )
        half_dim = self.matmul_half_dim if self.attention_half_dim is None else self.attention_half_dim
        return efficiency, half_dim

    def optimizer_tensor_seconds(self, dtensor: bool) -> float:
        """Host seconds AdamW's per-tensor loop spends on one parameter tensor (``dtensor``: a
        DTensor, as ZeRO-3's are); 0 where a multi-tensor kernel steps them all.

        Example::

            load_hardware("h100-80gb").optimizer_tensor_seconds(dtensor=False)   # 0.0
        """
        measured = self.dtensor_optimizer_tensor_us if dtensor else self.optimizer_tensor_us
        if measured is not None:
            return measured * 1e-6
        op_us = self.dtensor_op_overhead_us if dtensor else self.op_overhead_us
        return self.optimizer_ops_per_tensor * op_us * 1e-6

    def link_bandwidth(self, crosses_nodes: bool) -> float:
        """Bytes/s per device a ring collective reaches on the links it uses."""
        raw = self.inter_node_bandwidth if crosses_nodes else self.intra_node_bandwidth
        return raw * self.collective_efficiency

    def link_latency(self, crosses_nodes: bool) -> float:
        """Seconds per step of a collective (one hop of a ring) on those links."""
        return (self.inter_node_latency_us if crosses_nodes else self.intra_node_latency_us) * 1e-6

    def to_dict(self) -> dict[str, Any]:
        """The profile as JSON-ready builtins (``peak_tflops`` as an object).

        Example::

            Path("my-gpu.json").write_text(json.dumps(profile.to_dict(), indent=2))
        """
        return {**dataclasses.asdict(self), "peak_tflops": dict(self.peak_tflops)}

    @classmethod
    def from_dict(cls, profile_dict: Any) -> HardwareProfile:
        """The profile :meth:`to_dict` wrote; a missing or unknown field raises ``PlanError`` naming it.

        Example::

            HardwareProfile.from_dict(json.loads(Path("my-gpu.json").read_text()))
        """
        fields = {field.name: field for field in dataclasses.fields(cls)}
        if not isinstance(profile_dict, dict):
            raise PlanError(f"a hardware profile is a JSON object with the keys {list(fields)}")
        unknown = sorted(set(profile_dict) - set(fields))
        if unknown:
            raise PlanError(f"unknown hardware profile field(s) {unknown}; the fields are {list(fields)}")
        missing = [
            name
            for name, field in fields.items()
            if field.default is dataclasses.MISSING and name not in profile_dict
        ]
        if missing:
            raise PlanError(f"hardware profile field(s) {missing} missing")
        return cls(**profile_dict)


def _nvidia(
    name: str, bf16: float, fp32: float, tf32: float, memory_gb: float, hbm: float, **links: Any
) -> HardwareProfile:
    return HardwareProfile(
        name=name,
        peak_tflops=(("bf16", bf16), ("fp16", bf16), ("fp32", fp32), ("tf32", tf32), ("fp8", 2 * bf16))
        if name.startswith("h")
        else (("bf16", bf16), ("fp16", bf16), ("fp32", fp32), ("tf32", tf32)),
        memory_gb=memory_gb,
        memory_bandwidth=hbm,
        devices_per_node=8,
        source="NVIDIA data sheet (SXM, dense); links per device, one direction",
        **links,
    )


BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    # NVLink 4: 900 GB/s both directions; one ConnectX-7 (400 Gb/s NDR) per GPU.
    "h100-80gb": _nvidia(
        "h100-80gb", 989.4, 66.9, 494.7, 80.0, 3.35e12, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9
    ),
    "h200-141gb": _nvidia(
        "h200-141gb", 989.4, 66.9, 494.7, 141.0, 4.8e12, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9
    ),
    # NVLink 3: 600 GB/s both directions; one HDR (200 Gb/s) adapter per GPU.
    "a100-80gb": _nvidia(
        "a100-80gb", 312.0, 19.5, 156.0, 80.0, 2.039e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9
    ),
    "a100-40gb": _nvidia(
        "a100-40gb", 312.0, 19.5, 156.0, 40.0, 1.555e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9
    ),
}
"""The built-in profiles by name."""


def load_hardware(name_or_path: str | Path | HardwareProfile, *, world_size: int = 2) -> HardwareProfile:
    """A built-in profile by name, ``"cpu"`` measured now on ``world_size`` gloo ranks, or a JSON file.

    Example::

        load_hardware("a100-40gb").memory_gb      # 40.0
        load_hardware("profiles/my-cluster.json")
    """
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    key = str(name_or_path)
    if key in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[key]
    if key == "cpu":
        return calibrate_cpu(world_size)
    path = Path(key)
    if not path.is_file():
        raise PlanError(
            f"hardware {key!r} is neither a built-in profile ({', '.join([*BUILTIN_PROFILES, 'cpu'])}) "
            "nor a JSON file; write one with `vescale plan --calibrate` or HardwareProfile.to_dict"
        )
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PlanError(f"hardware profile {path} is not valid JSON: {error}") from None
    return HardwareProfile.from_dict(loaded)


def calibrate_cpu(world_size: int = 2) -> HardwareProfile:
    """The ``cpu`` profile of this machine, measured on ``world_size`` gloo ranks running at once.

    Each rank is a device; a node is this machine (``devices_per_node = world_size``), its memory
    the RAM shared by the ranks.

    Example::

        profile = calibrate_cpu(world_size=4)
        Path("cpu.json").write_text(json.dumps(profile.to_dict(), indent=2))
    """
    measured = measure_cpu(world_size)
    latency_us = measured["collective_latency_s"] * 1e6
    return HardwareProfile(
        name="cpu",
        peak_tflops=(("fp32", measured["fp32_flops"] / 1e12), ("bf16", measured["bf16_flops"] / 1e12)),
        memory_gb=measured["memory_bytes"] / world_size / 2**30,
        memory_bandwidth=measured["memory_bandwidth"],
        intra_node_bandwidth=measured["collective_bandwidth"],
        inter_node_bandwidth=measured["collective_bandwidth"],
        devices_per_node=world_size,
        intra_node_latency_us=latency_us,
        inter_node_latency_us=latency_us,
        matmul_efficiency=1.0,
        matmul_half_dim=1.0,
        memory_efficiency=1.0,
        collective_efficiency=1.0,
        op_overhead_us=measured["op_overhead_s"] * 1e6,
        matmul_overhead_us=measured["fp32_matmul_overhead_s"] * 1e6,
        dtensor_op_overhead_us=measured["dtensor_op_overhead_s"] * 1e6,
        overlaps_communication=False,
        optimizer_tensor_us=measured["optimizer_tensor_s"] * 1e6,
        dtensor_optimizer_tensor_us=measured["dtensor_optimizer_tensor_s"] * 1e6,
        ranks_per_core=max(1.0, world_size / measured["cores"]),
        all_gather_factor=measured["all_gather_factor"],
        reduce_scatter_factor=measured["reduce_scatter_factor"],
        zero_publish_factor=measured["zero_publish_factor"],
        redistribute_overhead_us=measured["redistribute_overhead_s"] * 1e6,
        collective_wait_us=measured["collective_wait_s"] * 1e6,
        attention_efficiency=measured["attention_efficiency"],
        attention_half_dim=measured["attention_half_dim"],
        source=f"measured on this machine for {world_size} gloo ranks (vescale plan --calibrate)",
    )
