"""``DDP``: data parallel over one mesh dim with bucketed, overlapped gradient averaging.

Each parameter's gradient is copied into its bucket (or, when the bucket has the
parameter's dtype, the gradient *is* a view of the bucket from the first step on, so
autograd accumulates into the bucket in place). The moment the last gradient of a bucket
arrives during backward, the bucket's averaging over the dp process group starts
asynchronously (:mod:`vescale.doptim.reduction`); all of them are waited for when the
backward pass ends. DTensor (tensor-parallel) parameters bucket their local shards: each
shard is averaged with the same shard on the other dp ranks. A gradient that arrives
``Partial`` over tp is first redistributed to its parameter's placements (dmodule's grad
sync would do the same at the end of backward, too late for a bucket launched during it),
so a bucket's dp reduction always reads tp-reduced gradients.

Over one rank (dp = 1, a pipeline- or tensor-only plan) nothing is reduced: a plain parameter
of the buckets' dtype keeps the gradient autograd makes (no hook, no bucket range, freed by
``zero_grad`` as without data parallelism) and the optimizer steps that gradient.

Under ZeRO-2 a bucket's full gradient buffer lives only from its first gradient to the end
of its reduce-scatter (:mod:`vescale.doptim.buckets`): at most ``MAX_BUCKETS_IN_FLIGHT``
reductions run at once (launching one more first completes the oldest), and a completed
one releases its buffer at once, so the gradients held per rank are 1/dp plus the few
buckets being filled or reduced.

The module is changed in place (hooks only: its parameters, forward and FQNs are kept), so
``optimizer_fn(model)`` after ``DDP(model, mesh)`` sees the same parameters.

Example::

    ddp = DDP(model, init_mesh(dp=4), bucket_size_mb=25)
    with ddp.no_sync():
        model(micro_batch_0).loss.backward()      # accumulates locally, no communication
    model(micro_batch_1).loss.backward()          # buckets averaged over dp during backward
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.doptim import _compat
from vescale.doptim.buckets import Bucket, ParamSlot, ReductionGroup, build_buckets, local_tensor
from vescale.doptim.errors import DataParallelConfigError, DataParallelMeshError
from vescale.doptim.mesh_groups import mesh_dim_names, mesh_dims_group
from vescale.doptim.reduction import BucketReduction, start_reduction
from vescale.dtensor.placements import from_local_like

__all__ = [
    "DATA_PARALLEL_ATTRIBUTE",
    "DDP",
    "MAX_BUCKETS_IN_FLIGHT",
    "data_parallel_of",
    "dp_mesh_dim_index",
    "dp_mesh_dims",
]

# The module and each of its parameters carry their DDP under this attribute.
DATA_PARALLEL_ATTRIBUTE = "_vescale_data_parallel"
# ZeRO-2: reductions allowed in flight at once, each holding a full-size bucket buffer. One
# keeps a collective running while the next bucket fills: a process group runs its collectives
# in order, so a second in flight only waited, holding another bucket (on 4 gloo ranks with
# 4 MiB buckets: peak 31 -> 28 MiB, step time within the runs' spread).
MAX_BUCKETS_IN_FLIGHT = 1


def _is_whole_bucket(bucket: Bucket, grad: torch.Tensor) -> bool:
    """Whether ``grad`` can serve as ZeRO-2's transient ``bucket`` buffer itself: the bucket holds
    this one gradient, unpadded, in its dtype, and ``grad`` owns its storage alone, contiguous
    (not a view into a larger tensor that a collective in place would write through, or keep
    alive). A large parameter's bucket then costs no second full-size gradient and no copy."""
    return (
        len(bucket.slots) == 1
        and grad.numel() == bucket.padded_numel
        and grad.dtype == bucket.grad_dtype
        and grad.is_contiguous()
        and grad.storage_offset() == 0
        and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
    )


def _is_bucket_range(bucket: Bucket, slot: ParamSlot, grad: torch.Tensor) -> bool:
    """Whether ``grad`` is ``slot``'s range of ``bucket``'s gradient buffer (autograd accumulated
    into it in place), found without building the view."""
    buffer = bucket.grad_buffer
    return (
        buffer is not None
        and grad.dtype == buffer.dtype
        and grad.data_ptr() == buffer.data_ptr() + slot.offset * buffer.element_size()
        and grad.is_contiguous()
    )


def dp_mesh_dim_index(device_mesh: DeviceMesh, mesh_dim: str) -> int:
    """The index of ``mesh_dim`` in ``device_mesh``, or a :class:`DataParallelMeshError` naming its dims."""
    names = device_mesh.mesh_dim_names or ()
    if mesh_dim not in names:
        raise DataParallelMeshError(
            f"mesh_dim={mesh_dim!r} is not a dimension of the mesh (its dims: {names}); build the mesh with "
            f"that dim, e.g. init_mesh({mesh_dim}=2, tp=2), or pass one of {names}"
        )
    return names.index(mesh_dim)


def dp_mesh_dims(device_mesh: DeviceMesh, mesh_dim: str | tuple[str, ...]) -> tuple[str, ...]:
    """``mesh_dim`` as a tuple of data-parallel mesh dims (``"dp"`` or ``("dp", "ep")``), each checked.

    Example::

        dp_mesh_dims(init_mesh(dp=2, ep=2), ("dp", "ep"))   # ('dp', 'ep')
    """
    dims = (mesh_dim,) if isinstance(mesh_dim, str) else tuple(mesh_dim)
    if not dims or len(set(dims)) != len(dims):
        raise DataParallelMeshError(
            f"mesh_dim={mesh_dim!r} must name one data-parallel mesh dim or several distinct ones, "
            "e.g. 'dp' or ('dp', 'ep')"
        )
    for dim in dims:
        dp_mesh_dim_index(device_mesh, dim)
    return dims


def _weak_gradient_hook(ddp: DDP) -> Callable[[torch.Tensor], None]:
    """``ddp._on_gradient`` through a weak reference (see ``DDP.__init__``)."""
    reference = weakref.ref(ddp)

    def on_gradient(param: torch.Tensor) -> None:
        owner = reference()
        if owner is not None:
            owner._on_gradient(param)

    return on_gradient


def _weak_forward_pre_hook(ddp: DDP) -> Callable[..., None]:
    """``ddp._point_grads_at_buckets`` through a weak reference, outside compiled code (it sets ``.grad``)."""
    reference = weakref.ref(ddp)

    def before_forward(module: nn.Module, args: tuple[Any, ...]) -> None:
        owner = reference()
        # Only before a forward that records a graph (not under no_grad, e.g. evaluation).
        if owner is not None and torch.is_grad_enabled():
            owner._point_grads_at_buckets()

    # torch leaves torch.compiler.disable unannotated.
    disabled: Callable[..., None] = torch.compiler.disable(before_forward)  # type: ignore[no-untyped-call]
    return disabled


def data_parallel_of(module_or_param: nn.Module | torch.Tensor) -> DDP | None:
    """The DDP applied to a module, or to the module that owns a parameter; ``None`` if none."""
    return getattr(module_or_param, DATA_PARALLEL_ATTRIBUTE, None)


def _check_parameter_mesh(
    fqn: str, param: torch.Tensor, device_mesh: DeviceMesh, dims: tuple[str, ...]
) -> None:
    if not isinstance(param, DTensor):
        return
    if param.device_mesh != device_mesh:
        raise DataParallelMeshError(
            f"parameter {fqn!r} lives on {param.device_mesh}, not on the data-parallel mesh {device_mesh}; "
            "parallelize the model on the same mesh you give to DDP/data_parallel"
        )
    names = mesh_dim_names(device_mesh)
    placement = param.placements[names.index(dims[0])]
    if len(dims) > 1:
        # Over several batch dims (dp x ep), a parameter sharded over one of them (an expert over ep)
        # holds that dim's whole gradient already and is reduced over the others.
        for dim in dims:
            placement = param.placements[names.index(dim)]
            if not isinstance(placement, Replicate | Shard):
                raise DataParallelMeshError(
                    f"parameter {fqn!r} is {placement} on the data-parallel mesh dim {dim!r}; DDP over "
                    f"{dims} takes parameters replicated or sharded (experts over ep) on each of them"
                )
        return
    dp_index = names.index(dims[0])
    if not isinstance(placement, Replicate):
        raise DataParallelMeshError(
            f"parameter {fqn!r} is {placement} on the data-parallel mesh dim {dp_index}; DDP averages "
            "gradients of parameters replicated over dp. Shard it over another dim (e.g. 'tp'), or use "
            "data_parallel(..., zero_stage=3) to shard parameters over dp"
        )


class DDP:
    """Average a module's gradients over ``device_mesh[mesh_dim]`` in contiguous buckets.

    ``mesh_dim`` may name several dims, ``("dp", "ep")`` under expert parallelism: the batch is
    split over all of them, each gradient is divided by their number of ranks, and a parameter
    sharded over one of them (an expert over ``ep``, whose gradient the all-to-all already summed
    over the ep ranks' tokens) is summed over the others only (its buckets' ZeRO chunks too).

    ``overlap=False`` starts every bucket's reduction when backward ends instead of as soon
    as the bucket is ready. ``deterministic=True`` sums the ranks' gradients in rank order
    (bitwise reproducible, see :mod:`vescale.doptim.reduction`). ``zero_stage`` 1 keeps the
    all-reduce and lets :class:`~vescale.doptim.DistributedOptimizer` shard the optimizer
    state; 2 reduce-scatters, leaving each rank only its chunk of each bucket
    (``param.grad`` is then ``None`` after the synchronising backward).

    ``grad_dtype`` is the narrowest dtype gradients are bucketed and reduced in: float32 for bf16
    parameters, and a float64 model's own float64 (its gradients are never rounded to float32).

    A parameter that gets no gradient on a rank in an accumulation window counts as zero
    there. ``find_unused_parameters=True`` also finds the parameters no rank used (one small
    all-reduce per synchronising backward) and leaves them without a gradient, so the
    optimizer skips them as it would on one device (no weight decay, no momentum step).

    Example::

        ddp = DDP(model, mesh, mesh_dim="dp", deterministic=True)
        model(batch).loss.backward()
        optimizer.step()
    """

    def __init__(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        mesh_dim: str | tuple[str, ...] = "dp",
        bucket_size_mb: float = 25,
        overlap: bool = True,
        grad_dtype: torch.dtype = torch.float32,
        deterministic: bool = False,
        zero_stage: int = 0,
        find_unused_parameters: bool = False,
    ) -> None:
        if zero_stage not in (0, 1, 2):
            raise DataParallelConfigError(
                f"DDP takes zero_stage 0, 1 or 2, not {zero_stage!r}; ZeRO-3 shards parameters: use "
                "vescale.doptim.data_parallel(model, mesh, zero_stage=3)"
            )
        if not bucket_size_mb > 0:
            raise DataParallelConfigError(f"bucket_size_mb must be positive, not {bucket_size_mb!r}")
        if data_parallel_of(module) is not None:
            raise DataParallelConfigError(
                "the module is data-parallel already; apply DDP/data_parallel once per model"
            )
        self.mesh_dims = dp_mesh_dims(device_mesh, mesh_dim)
        named_parameters = [(fqn, param) for fqn, param in module.named_parameters() if param.requires_grad]
        for fqn, param in named_parameters:
            _check_parameter_mesh(fqn, param, device_mesh, self.mesh_dims)
        self.module = module
        self.device_mesh = device_mesh
        self.mesh_dim = mesh_dim
        self.dp_group, self.dp_size, self.dp_rank = mesh_dims_group(device_mesh, self.mesh_dims)
        self._reductions_by_dims: dict[tuple[str, ...], ReductionGroup] = {}
        self.overlap = overlap
        grad_dtype = functools.reduce(
            torch.promote_types, (param.dtype for _, param in named_parameters), grad_dtype
        )
        self.grad_dtype = grad_dtype
        self.deterministic = deterministic
        self.zero_stage = zero_stage
        self.find_unused_parameters = find_unused_parameters
        # ids of the parameters no dp rank computed a gradient for in the accumulation window.
        self.unused_params: frozenset[int] = frozenset()
        # The parameters a gradient reached in the window: every backward since the optimizer last
        # stepped or cleared the gradients.
        self._reached_in_window: set[int] = set()
        self._window_closed = False
        self.buckets: list[Bucket] = build_buckets(
            named_parameters,
            bucket_size_bytes=int(bucket_size_mb * 2**20),
            dp_size=self.dp_size,
            grad_dtype=grad_dtype,
            # Over one rank a bucket's buffer holds only the hooked parameters' gradients (DTensors,
            # other dtypes): allocated when the first of them needs it, never for plain ones.
            lazy=zero_stage == 2 or self.dp_size == 1,
            reduction_of=self.reduction_of,
        )
        self._slot_of: dict[int, tuple[Bucket, int]] = {}
        for bucket in self.buckets:
            for position, slot in enumerate(bucket.slots):
                self._slot_of[id(slot.param)] = (bucket, position)
        self._sync_enabled = True
        self._callback_queued = False
        self._grads_arrived = False
        self._reductions: dict[int, BucketReduction] = {}
        # ZeRO-2: a bucket's chunk reduced by another backward of this step (the caller accumulating
        # without no_sync), by bucket index: the kept chunk gets it added on completion.
        self._chunks_to_add: dict[int, torch.Tensor] = {}
        # Parameters whose gradient does not have the bucket's dtype: which ones the bucket holds a
        # value of, in this window (ZeRO 0-1, whose buckets keep the window's reduced gradients) or
        # this backward (ZeRO-2, whose full buckets live one backward).
        self._accumulated: set[int] = set()
        # The hooks hold this DDP weakly: torch keeps a parameter's hooks from C++, where the garbage
        # collector cannot see them, so a strong hook -> DDP -> module -> parameter cycle would keep
        # a dropped model (and its process groups) alive for the life of the process.
        on_gradient = _weak_gradient_hook(self)
        # One rank over the batch dims has nothing to reduce: a plain parameter of the buckets'
        # dtype then keeps the gradient autograd gives it (no hook, no bucket range, freed by
        # zero_grad as without DDP), and the optimizer steps that gradient (load_grads).
        unhooked = {id(param) for _, param in named_parameters if not self._needs_gradient_hook(param)}
        self._unhooked = unhooked
        self._hook_handles = [
            # torch leaves register_post_accumulate_grad_hook unannotated.
            param.register_post_accumulate_grad_hook(on_gradient)  # type: ignore[no-untyped-call]
            for _, param in named_parameters
            if id(param) not in unhooked
        ]
        self._hook_handles.append(module.register_forward_pre_hook(_weak_forward_pre_hook(self)))
        setattr(module, DATA_PARALLEL_ATTRIBUTE, self)
        for _, param in named_parameters:
            setattr(param, DATA_PARALLEL_ATTRIBUTE, self)

    def _needs_gradient_hook(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient must pass through :meth:`_on_gradient` after each backward:
        always but for a plain parameter of the buckets' dtype when one rank holds the whole batch
        (no reduction, no ZeRO-2 chunk, no search for unused parameters)."""
        alone = self.dp_size == 1 and self.zero_stage != 2 and not self.find_unused_parameters
        return not (alone and not isinstance(param, DTensor) and self._grad_is_bucket_view(param))

    @property
    def _reduces(self) -> bool:
        """Whether buckets are reduced at all: not over one rank (but ZeRO-2's chunk is still filled)."""
        return self.dp_size > 1 or self.zero_stage == 2

    @torch.no_grad()
    def take_accumulated_gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient accumulated for ``param`` inside :meth:`no_sync` where its bucket holds it
        (a parameter of another dtype than the buckets', whose ``.grad`` the hook moves there), as a
        new tensor of the parameter's dtype and kind; the bucket forgets it. ``None`` where the
        gradient is ``param.grad`` itself (a bucket view) or none arrived.

        Who rescales or sums gradients between ``no_sync`` and the backward that reduces them
        (``vescale.dpipe``) hands this back as ``param.grad`` first; the next gradient hook then
        copies it into the bucket instead of adding to the old value.

        Example::

            if param.grad is None:
                param.grad = ddp.take_accumulated_gradient(param)
        """
        if id(param) not in self._accumulated:
            return None
        self._accumulated.discard(id(param))
        bucket, position = self._slot_of[id(param)]
        bucket.ready.discard(position)
        gradient = bucket.grad_view(bucket.slots[position]).to(param.dtype, copy=True)
        return self._wrap_like(param, gradient)

    def keeps_own_gradient(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient stays the tensor autograd made (one rank, no hook): the
        optimizer then steps ``param.grad`` itself, not a bucket range."""
        return id(param) in self._unhooked

    def reduction_of(self, param: torch.Tensor) -> ReductionGroup:
        """The ranks ``param``'s gradient is summed over: the data-parallel dims it is replicated on."""
        dims = self.mesh_dims
        if isinstance(param, DTensor) and len(dims) > 1:
            names = mesh_dim_names(self.device_mesh)
            dims = tuple(dim for dim in dims if isinstance(param.placements[names.index(dim)], Replicate))
        if dims not in self._reductions_by_dims:
            group, size, rank = mesh_dims_group(self.device_mesh, dims)
            self._reductions_by_dims[dims] = ReductionGroup(dims, group, size, rank, self.dp_size)
        return self._reductions_by_dims[dims]

    @property
    def reduce_result(self) -> str:
        """``"reduce_scatter"`` under ZeRO-2, else ``"all_reduce"``."""
        return "reduce_scatter" if self.zero_stage == 2 else "all_reduce"

    def slots(self) -> Iterator[tuple[Bucket, ParamSlot]]:
        """Every (bucket, parameter slot), in bucket order."""
        for bucket in self.buckets:
            for slot in bucket.slots:
                yield bucket, slot

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally for the backward passes run inside; the next one outside averages.

        Example::

            with ddp.no_sync():
                model(micro_batch_0).loss.backward()
            model(micro_batch_1).loss.backward()
        """
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Start the reductions that have not started (unused parameters count as zero) and wait for all.

        Called at the end of every synchronising backward; a no-op when no gradient arrived since.
        """
        if not self._grads_arrived:
            return
        for bucket in self.buckets:
            if bucket.index not in self._reductions:
                self._complete_unused(bucket)
                if self._reduces:
                    self._launch(bucket)
        if self._reduces:
            for bucket in self.buckets:
                self._complete(bucket)
        self._reductions.clear()
        if self.find_unused_parameters:
            self._drop_globally_unused()
        if self.zero_stage == 2:
            self._accumulated.clear()
        self._grads_arrived = False

    def gradients_consumed(self) -> None:
        """The optimizer stepped on the gradients or cleared them: the next backward starts a new
        accumulation window, as ``.grad`` does on one device after ``zero_grad`` (``optimizer``'s or
        the model's: a loop that never clears its gradients between steps is the one case that
        differs, where one device would add the steps' gradients up).

        Until then, every synchronising backward adds to the window's gradients: ZeRO-2's reduced
        chunks, the buckets' ranges of gradients not in the buckets' dtype, and the record of which
        parameters some rank used (``find_unused_parameters``).
        """
        self._window_closed = True

    def _open_window(self) -> None:
        self._window_closed = False
        self.release_grad_chunks()
        self._accumulated.clear()
        self._reached_in_window.clear()

    def _drop_globally_unused(self) -> None:
        params = [slot.param for _, slot in self.slots()]
        reached = self._reached_in_window
        received = torch.tensor([id(param) in reached for param in params], dtype=torch.int32)
        dist.all_reduce(received, op=dist.ReduceOp.MAX, group=self.dp_group)
        self.unused_params = frozenset(
            id(param) for param, used in zip(params, received.tolist(), strict=True) if not used
        )
        for param in params:
            if id(param) in self.unused_params:
                param.grad = None

    def release_grad_chunks(self) -> None:
        """ZeRO-2: drop each bucket's reduced chunk (the optimizer has stepped; the next backward
        allocates new ones)."""
        for bucket in self.buckets:
            bucket.grad_chunk = None

    def remove(self) -> None:
        """Remove the hooks; the module is no longer data-parallel."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        for _, slot in self.slots():
            delattr(slot.param, DATA_PARALLEL_ATTRIBUTE)
        delattr(self.module, DATA_PARALLEL_ATTRIBUTE)

    @torch.no_grad()
    def _point_grads_at_buckets(self) -> None:
        """Before a forward that records a graph: plain parameters without a gradient get their zeroed
        bucket range as ``.grad``, so that autograd accumulates into the bucket in place and the
        gradient hook copies nothing (torch DDP's ``gradient_as_bucket_view``). Without it every
        step after ``zero_grad()`` allocated each gradient afresh and copied it into the bucket.

        DTensor parameters (their gradient may arrive ``Partial``), other dtypes than the
        buckets' and ZeRO-2's transient buffers keep the copying path.
        """
        if self.zero_stage == 2:
            return
        for bucket in self.buckets:
            slots = [
                slot
                for slot in bucket.slots
                if slot.param.grad is None
                and slot.param.requires_grad
                and id(slot.param) not in self._unhooked
                and not isinstance(slot.param, DTensor)
                and self._grad_is_bucket_view(slot.param)
            ]
            if not slots:
                continue
            if len(slots) == len(bucket.slots):
                bucket.allocate_grad_buffer().zero_()  # one fill, not one per parameter
            else:
                for slot in slots:
                    bucket.grad_view(slot).zero_()
            for slot in slots:
                slot.param.grad = bucket.grad_view(slot)

    def _grad_is_bucket_view(self, param: torch.Tensor) -> bool:
        return param.dtype == self.grad_dtype

    def _wrap_like(self, param: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return view
        return from_local_like(view, param)

    @torch.no_grad()
    def _on_gradient(self, param: torch.Tensor) -> None:
        bucket, position = self._slot_of[id(param)]
        slot = bucket.slots[position]
        if self._window_closed:
            self._open_window()
        self._grads_arrived = True
        self._reached_in_window.add(id(param))
        if not self._callback_queued:
            self._callback_queued = True
            _compat.queue_end_of_backward_callback(self._end_of_backward)
        grad = param.grad
        if grad is None:  # a post-accumulate-grad hook runs once the gradient is there
            raise DataParallelConfigError(
                f"parameter {slot.fqn!r} reached its gradient hook without a gradient"
            )
        if isinstance(grad, DTensor):
            dparam = cast(DTensor, param)  # a DTensor gradient belongs to a DTensor parameter
            if tuple(grad.placements) != tuple(dparam.placements):
                grad = grad.redistribute(dparam.device_mesh, dparam.placements)
        local = local_tensor(grad)
        if self.zero_stage == 2 and bucket.grad_buffer is None and _is_whole_bucket(bucket, local):
            bucket.grad_buffer = local.view(-1)  # reduced in place: no bucket of its own, no copy
        if self._grad_is_bucket_view(param):
            # param.grad always holds the accumulated gradient (in place when it is the view already).
            # A plain gradient that is its bucket range already (the usual case from the second
            # step on) needs nothing: no view to build, no copy, no new .grad.
            if isinstance(grad, DTensor) or not _is_bucket_range(bucket, slot, local):
                view = bucket.grad_view(slot)
                if local.data_ptr() != view.data_ptr():
                    view.copy_(local)
                param.grad = self._wrap_like(param, view)
        else:
            view = bucket.grad_view(slot)
            if id(param) in self._accumulated:
                view.add_(local)
            else:
                view.copy_(local)
                self._accumulated.add(id(param))
            param.grad = None
        bucket.ready.add(position)
        if self._sync_enabled and self.overlap and self._reduces:
            self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        """Launch the full buckets, in bucket order only: every rank must issue the same collectives
        in the same order, and a bucket holding a parameter this rank did not use never fills here
        (it waits for the end of backward, and the buckets after it with it)."""
        for bucket in self.buckets[len(self._reductions) :]:
            if len(bucket.ready) != len(bucket.slots):
                return
            self._launch(bucket)

    def _complete_unused(self, bucket: Bucket) -> None:
        """Zero the bucket ranges of parameters that got no gradient in this accumulation window."""
        for position, slot in enumerate(bucket.slots):
            param = slot.param
            if position in bucket.ready or id(param) in self._unhooked:
                continue
            view = bucket.grad_view(slot)
            if self._grad_is_bucket_view(param):
                if param.grad is None:
                    view.zero_()
                    param.grad = self._wrap_like(param, view)
            elif id(param) not in self._accumulated:
                view.zero_()

    def _launch(self, bucket: Bucket) -> None:
        chunk = None
        if self.zero_stage == 2:
            kept = bucket.grad_chunk
            if kept is None:
                chunk = bucket.allocate_grad_chunk()
            else:
                # The chunk holds an earlier backward's reduced gradient of this step: the gradients
                # accumulate (as .grad does on one device) until zero_grad releases the chunk.
                chunk = torch.empty_like(kept)
                self._chunks_to_add[bucket.index] = chunk
        self._reductions[bucket.index] = start_reduction(
            bucket,
            bucket.reduction_group.group,
            result=self.reduce_result,
            deterministic=self.deterministic,
            grad_chunk=chunk,
        )
        if self.zero_stage != 2:
            return
        # Completing early may differ between ranks: safe because a reduce-scatter's wait issues
        # no collective (only the deterministic all-reduce's does, and ZeRO-2 never all-reduces).
        in_flight = [index for index, reduction in self._reductions.items() if not reduction.done]
        for position, index in enumerate(in_flight):
            must_finish = len(in_flight) - position > MAX_BUCKETS_IN_FLIGHT
            if must_finish or self._reductions[index].is_completed():
                self._complete(self.buckets[index])

    def _complete(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s reduction; under ZeRO-2 release its full buffer, keeping the chunk."""
        self._reductions[bucket.index].wait()
        later = self._chunks_to_add.pop(bucket.index, None)
        if later is not None:
            bucket.reduced_chunk().add_(later)
        if self.zero_stage == 2 and bucket.grad_buffer is not None:
            # Only this rank's chunk is averaged: the full buffer must not pass for gradients.
            for slot in bucket.slots:
                slot.param.grad = None
            bucket.grad_buffer = None

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._sync_enabled:
            self.finish_grad_sync()
        for bucket in self.buckets:
            bucket.ready.clear()
