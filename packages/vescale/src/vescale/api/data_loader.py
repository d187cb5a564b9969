"""``DistributedDataLoader``: one global batch per step, each dp rank yielding its contiguous slice.

The sequence of global batches depends only on the dataset, ``global_batch_size``, ``shuffle``,
``seed`` and ``drop_last``, never on the parallel plan: with ``shuffle=False`` it is exactly the
sequence of ``torch.utils.data.DataLoader(dataset, batch_size=global_batch_size)``. Each step, dp
rank ``r`` of ``d`` yields rows ``[r * global_batch_size // d, (r + 1) * global_batch_size // d)``
of the global batch, collated; every tp/pp rank of one dp index yields the identical batch.

Map-style datasets are indexed: each rank fetches only its own rows. An iterable dataset has no
index, so every rank reads the whole stream and keeps its slice (``d`` times the reading of one
process), and resuming mid-epoch re-reads the part of the epoch already consumed.

Random numbers are those of the single-device loop too: ``iter(loader)`` at an epoch's start
draws one number from the default generator, as ``iter(torch.utils.data.DataLoader(...))`` does,
so a model's dropout after it draws what one device draws (``shuffle=True`` orders each epoch
from ``seed`` and the epoch, on a generator of its own).

The position (epoch, batches consumed) is a JSON-able ``state_dict()``; ``iter(loader)`` starts
where the position is, so a loop over the loader after ``load_state_dict`` continues at the next
global batch, under any dp size.

Example::

    loader = DistributedDataLoader(dataset, init_mesh(dp=2, tp=2), global_batch_size=8, shuffle=True)
    for batch in loader: ...          # this dp rank's 4 rows of each global batch of 8
    loader.load_state_dict(saved)     # resume: the next iteration yields the next global batch
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import IterableDataset, default_collate

from vescale.api.errors import VescaleAPIError

__all__ = ["DataLoaderConfigError", "DataLoaderError", "DataLoaderStateError", "DistributedDataLoader"]

STATE_FORMAT = "vescale.data_loader/1"
# Fields of the state dict that decide the sequence of global batches: a resumed loader must
# have the same ones, or it would continue a different sequence than the one saved.
_SEQUENCE_FIELDS = ("global_batch_size", "shuffle", "seed", "drop_last", "num_samples")


class DataLoaderError(VescaleAPIError, ValueError):
    """Base class of the errors ``DistributedDataLoader`` raises on purpose."""


class DataLoaderConfigError(DataLoaderError):
    """A ``DistributedDataLoader`` argument is invalid (batch size, mesh dim, dataset kind)."""


class DataLoaderStateError(DataLoaderError):
    """A data-loader state dict does not fit the loader it is loaded into."""


def _is_int_at_least(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_map_style(dataset: Any) -> bool:
    if isinstance(dataset, IterableDataset):
        return False
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return True
    if hasattr(dataset, "__iter__"):
        return False
    raise DataLoaderConfigError(
        f"the dataset (a {type(dataset).__name__}) has neither __getitem__ and __len__ (map-style) nor "
        "__iter__ (iterable); pass a torch.utils.data.Dataset or IterableDataset"
    )


def _dp_rank_and_size(mesh: DeviceMesh, dp_dim: str | tuple[str, ...]) -> tuple[int, int]:
    """This rank's index among the batch ranks (several dims flattened, outer first) and their number."""
    names = mesh.mesh_dim_names or ()
    rank, size = 0, 1
    for dim in (dp_dim,) if isinstance(dp_dim, str) else dp_dim:
        if dim not in names:
            raise DataLoaderConfigError(
                f"dp_dim={dim!r} is not a dimension of the mesh (its dims: {list(names)}); pass the name "
                "of the data-parallel dim, or build the mesh with it, e.g. init_mesh(dp=1, tp=...)"
            )
        dim_size = mesh.size(names.index(dim))
        rank, size = rank * dim_size + mesh.get_local_rank(dim), size * dim_size
    return rank, size


class DistributedDataLoader:
    """This dp rank's contiguous slice of each global batch of ``dataset`` (see the module docstring).

    ``collate_fn`` turns the rank's list of samples into a batch (default: torch's
    ``default_collate``). ``shuffle`` permutes a map-style dataset each epoch with
    ``torch.randperm`` seeded by ``seed + epoch``, identically on every rank. ``drop_last=False``
    keeps a short last global batch, which must still split into equal dp slices.
    ``dp_dim=("dp", "ep")`` splits the batch over both dims (expert parallelism), dp outer.

    Example::

        loader = DistributedDataLoader(dataset, mesh, global_batch_size=8, collate_fn=pad_batch)
        for batch in loader:
            model(**batch).loss.backward()
    """

    def __init__(
        self,
        dataset: Any,
        mesh: DeviceMesh,
        *,
        global_batch_size: int,
        dp_dim: str | tuple[str, ...] = "dp",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        self.dataset = dataset
        self.map_style = _is_map_style(dataset)
        self.dp_rank, self.dp_size = _dp_rank_and_size(mesh, dp_dim)
        if not _is_int_at_least(global_batch_size, 1):
            raise DataLoaderConfigError(
                f"global_batch_size must be a positive integer, got {global_batch_size!r}"
            )
        if global_batch_size % self.dp_size:
            raise DataLoaderConfigError(
                f"global_batch_size={global_batch_size} does not split into {self.dp_size} equal slices over "
                f"mesh dim {dp_dim!r}; make it a multiple of {self.dp_size}"
            )
        if collate_fn is not None and not callable(collate_fn):
            raise DataLoaderConfigError(f"collate_fn must be callable, got a {type(collate_fn).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise DataLoaderConfigError(f"seed must be an integer, got {seed!r}")
        if shuffle and not self.map_style:
            raise DataLoaderConfigError(
                "shuffle=True needs a map-style dataset (indexable, with a length); an iterable dataset is "
                "read in its own order: shuffle inside the stream, or pass shuffle=False"
            )
        self.global_batch_size = global_batch_size
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.num_samples: int | None = len(dataset) if self.map_style else None
        if self.num_samples is not None:
            self._check_last_batch(self.num_samples % global_batch_size)
        self.epoch = 0
        self.batches_consumed = 0
        # Bumped by load_state_dict: an iterator started before it would continue the old position.
        self._position_version = 0

    @property
    def local_batch_size(self) -> int:
        """Rows per dp rank in a full global batch."""
        return self.global_batch_size // self.dp_size

    def __len__(self) -> int:
        """Global batches per epoch (what ``len(torch.utils.data.DataLoader(...))`` gives)."""
        size = self.num_samples
        if size is None:
            if not hasattr(self.dataset, "__len__"):
                raise TypeError(
                    f"the iterable dataset (a {type(self.dataset).__name__}) has no __len__, so the loader "
                    "has no length; count steps yourself"
                )
            size = len(self.dataset)
        full, rest = divmod(size, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _check_last_batch(self, rows: int) -> None:
        if rows and not self.drop_last and rows % self.dp_size:
            raise DataLoaderConfigError(
                f"drop_last=False keeps a last global batch of {rows} samples, which does not split into "
                f"{self.dp_size} equal dp slices; pass drop_last=True or make the dataset size a multiple "
                f"of {self.dp_size} beyond the last full batch of {self.global_batch_size}"
            )

    def _epoch_order(self) -> list[int]:
        assert self.num_samples is not None
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def _local_rows(self, global_rows: list[Any]) -> list[Any]:
        share = len(global_rows) // self.dp_size
        return global_rows[self.dp_rank * share : (self.dp_rank + 1) * share]

    def _global_batches(self) -> Iterator[list[Any]]:
        """The rest of this epoch's global batches, from the current position: indices or samples."""
        start = self.batches_consumed * self.global_batch_size
        if self.map_style:
            order = self._epoch_order()
            stop = len(order) - len(order) % self.global_batch_size if self.drop_last else len(order)
            for offset in range(start, stop, self.global_batch_size):
                yield order[offset : offset + self.global_batch_size]
            return
        stream = itertools.islice(iter(self.dataset), start, None)
        while batch := list(itertools.islice(stream, self.global_batch_size)):
            if len(batch) < self.global_batch_size:
                if self.drop_last:
                    return
                self._check_last_batch(len(batch))
            yield batch

    def __iter__(self) -> Iterator[Any]:
        """This rank's collated slice of each remaining global batch of the current epoch.

        Starting an epoch draws one number from the default generator, as ``iter()`` of a
        ``torch.utils.data.DataLoader`` does (its workers' base seed): the random numbers a model
        draws afterwards (dropout) are then those of the single-device loop. Resuming mid-epoch
        draws nothing, as the uninterrupted loop drew nothing there.
        """
        if self.batches_consumed == 0:
            torch.empty((), dtype=torch.int64).random_()
        return self._rows_of_epoch()

    def _rows_of_epoch(self) -> Iterator[Any]:
        version = self._position_version
        batches = self._global_batches()
        upcoming = next(batches, None)
        if upcoming is None:
            self._advance(last_of_epoch=True)
        while upcoming is not None:
            # One global batch of look-ahead tells whether this one ends the epoch, so the position
            # saved while the last batch trains is already the next epoch's start.
            global_rows, upcoming = upcoming, next(batches, None)
            if version != self._position_version:
                raise DataLoaderStateError(
                    "load_state_dict() moved the loader while this iterator was running; start a new "
                    "iteration (for batch in loader) to continue from the loaded position"
                )
            local_rows = self._local_rows(global_rows)
            samples = [self.dataset[index] for index in local_rows] if self.map_style else local_rows
            # Advanced before the yield: a checkpoint taken while this batch trains resumes after it.
            self._advance(last_of_epoch=upcoming is None)
            yield self.collate_fn(samples)

    def _advance(self, last_of_epoch: bool) -> None:
        if last_of_epoch:
            self.epoch += 1
            self.batches_consumed = 0
        else:
            self.batches_consumed += 1

    def state_dict(self) -> dict[str, Any]:
        """The position as JSON-able builtins; ``dp_size`` is informative (any dp size may load it).

        Example::

            json.dumps(loader.state_dict())   # {"format": ..., "epoch": 0, "batches_consumed": 3, ...}
        """
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "num_samples": self.num_samples,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Move to the saved position; the sequence settings must equal this loader's.

        Example::

            loader.load_state_dict(saved)   # saved under dp=2, loaded under dp=4: same global batches
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            found = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise DataLoaderStateError(
                f"not a DistributedDataLoader state (format {found!r}, expected {STATE_FORMAT!r}); pass "
                "what DistributedDataLoader.state_dict() returned"
            )
        current = self.state_dict()
        for field in _SEQUENCE_FIELDS:
            if state_dict.get(field) != current[field]:
                raise DataLoaderStateError(
                    f"the saved data-loader state has {field}={state_dict.get(field)!r}, this loader "
                    f"{field}={current[field]!r}: it would continue a different sequence of global batches; "
                    f"build the loader with {field}={state_dict.get(field)!r}"
                )
        for field in ("epoch", "batches_consumed"):
            value = state_dict.get(field)
            if not _is_int_at_least(value, 0):
                raise DataLoaderStateError(
                    f"the saved data-loader state has {field}={value!r}; expected an integer >= 0"
                )
        self.epoch = state_dict["epoch"]
        self.batches_consumed = state_dict["batches_consumed"]
        self._position_version += 1
