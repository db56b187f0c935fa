"""Residual contexts as an item of an Orbax checkpoint: saved with the train state, as one step.

``ContextsSave`` and ``ContextsRestore`` are Orbax checkpoint arguments (registered with
``ocp.args.register_with_handler``), so ``ocp.args.Composite`` takes them beside the state's own
and one ``CheckpointManager.save`` commits both: Orbax creates the step's folders, finalizes the
step atomically, applies ``max_to_keep`` and the multi-host rules, and this module writes the
contexts item as a residual store (``rs.Store`` on the item's folder), so the command line opens
it, ``verify`` checks it, and a process without the model runs its backwards.

The save is asynchronous, as Orbax's own are: ``save`` takes host copies of every context
(weights included) before it returns, so the caller may donate or delete its arrays at once, and
the item's files are written by Orbax's commit thread while training goes on.

The item records what it holds (keys, each manifest's checksum, the step folder), written in the
step's commit: ``ContextsRestore`` and ``verify`` compare the item with it, so a context removed,
added or replaced, another step's item copied in, or an item partly deleted (a crash while
``max_to_keep`` deletes its step) raises :class:`rs.CorruptContextError` naming it, never a smaller
or another step's store handed over as whole (see ``_src/store/item_record.py``).

Weights the contexts share with the train state are stored once in the item (the store stores
each weight once, however many contexts hold it), not as a reference to the state's files: the
item stays a store of its own that needs no other item, at the cost of one more copy of the
weights per step (see ``docs/orbax.md``).

Example:
  >>> import tempfile, jax.numpy as jnp, orbax.checkpoint as ocp, residual_store as rs
  >>> from residual_store import orbax as rso
  >>> fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
  >>> w = jnp.ones((3, 2))
  >>> _, ctx = fwd(w, jnp.ones((4, 3)))
  >>> with tempfile.TemporaryDirectory() as d, ocp.CheckpointManager(d) as mngr:
  ...     _ = mngr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": w}),
  ...                                               contexts=rso.ContextsSave({"mb0": ctx})))
  ...     mngr.wait_until_finished()
  ...     restored = mngr.restore(0, args=ocp.args.Composite(contexts=rso.ContextsRestore()))
  ...     with restored.contexts as store:
  ...         grads = rs.backward(store.get("mb0"))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

try:
    import orbax.checkpoint as ocp
except ImportError as err:  # pragma: no cover - exercised in a process without orbax
    raise ImportError(
        "residual_store.orbax needs orbax-checkpoint, which residual-store does not install by "
        "default: pip install 'residual-store[orbax]'"
    ) from err

from residual_store._src import _jax_internals
from residual_store._src.backward import Backward, find_backward
from residual_store._src.context import ResidualContext
from residual_store._src.errors import CorruptContextError, InvalidArgumentError, StoreNotFoundError
from residual_store._src.store import Store, item_record
from residual_store._src.store.copies import detached
from residual_store._src.store.disk.paths import validate_key
from residual_store._src.store.disk.tier import DiskTier
from residual_store._src.store.host import check_live

if TYPE_CHECKING:
    from etils import epath

__all__ = ["ContextsHandler", "ContextsRestore", "ContextsSave"]

Contexts = Mapping[str, ResidualContext] | Store


def _check_contexts(contexts: Any) -> None:
    """Raises for what cannot be saved, before anything is written.

    Raises:
      InvalidArgumentError: neither a mapping nor an ``rs.Store``, or a value that is not a
        context (or is one inside a transformation).
      InvalidKeyError: a key outside the store's key rules.
    """
    if isinstance(contexts, Store):
        return
    if not isinstance(contexts, Mapping):
        raise InvalidArgumentError(
            "ContextsSave expects a mapping from key to rs.ResidualContext, or an rs.Store, got "
            f"{type(contexts).__name__}"
        )
    for key, ctx in contexts.items():
        validate_key(key)
        if not isinstance(ctx, ResidualContext):
            raise InvalidArgumentError(
                f"ContextsSave: the value of {key!r} is a {type(ctx).__name__}, not an rs.ResidualContext"
            )
        if _jax_internals.any_tracer(ctx.residuals):
            raise InvalidArgumentError(
                f"ContextsSave: context {key!r} holds tracers (it was made inside jax.jit or another "
                "transformation): return it from the transformed function and save it there"
            )
        check_live(ctx, "before it was saved")


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """What a save writes after it returned: host copies of the contexts, the backwards of their
    signatures (held, so the store can export them even if the split is gone by then), and the
    name of the step folder the item is saved in (what its record names)."""

    contexts: Mapping[str, ResidualContext]
    backwards: tuple[Backward | None, ...]
    step: str


def _step_folder(directory: epath.Path | str | os.PathLike[str]) -> str:
    """The name of the step folder an item folder lies in, as the committed step has it: Orbax
    saves into ``<step>.orbax-checkpoint-tmp.../<item>.orbax-checkpoint-tmp...`` and renames
    both into place (on object stores it writes the final folders and a commit file).

    Example:
      >>> _step_folder("/ckpt/7.orbax-checkpoint-tmp-1712/contexts.orbax-checkpoint-tmp-1712")
      '7'
    """
    name = os.path.basename(os.path.dirname(os.fspath(directory).rstrip("/")))
    end = name.find(ocp.path.step.TMP_DIR_SUFFIX)
    return name[:end] if end >= 0 else name


def _snapshot(contexts: Contexts, step: str) -> _Snapshot:
    """Host copies of ``contexts`` (one copy per distinct array), taken on the caller's thread: a
    mapping's in one transfer; a store's every context, one at a time (read from its tiers, so
    that only one of them is on the device at once for the copy), as the store holds them now;
    ``step``: the name of the step folder they are saved in."""
    if isinstance(contexts, Store):
        weights: dict[int, Any] = {}
        copies = {key: detached({key: contexts.get(key)}, weights)[key] for key in contexts.keys()}
    else:
        copies = detached(contexts)
    held = {ctx.spec.signature: find_backward(ctx.spec.signature) for ctx in copies.values()}
    return _Snapshot(copies, tuple(held.values()), step)


def _store_path(directory: epath.Path | str | os.PathLike[str]) -> str | dict[str, str]:
    """The ``rs.Store`` path of an Orbax item folder: a local folder as is, a ``gs://`` or
    ``s3://`` folder as the tensorstore kvstore spec of that bucket and prefix.

    Example:
      >>> _store_path("gs://bucket/run/3/contexts")
      {'driver': 'gcs', 'bucket': 'bucket', 'path': 'run/3/contexts/'}

    Raises:
      InvalidArgumentError: a folder of another file system (``scheme://``), which a store
        cannot open.
    """
    text = os.fspath(directory)
    for scheme, driver in (("gs://", "gcs"), ("s3://", "s3")):
        if text.startswith(scheme):
            bucket, _, prefix = text[len(scheme):].partition("/")
            return {"driver": driver, "bucket": bucket, "path": prefix.rstrip("/") + "/"}
    if "://" in text:
        raise InvalidArgumentError(
            f"cannot save contexts in {text}: a residual store opens local folders, gs:// and s3:// only"
        )
    return text


def _write(path: str | dict[str, str], snapshot: _Snapshot) -> None:
    """Writes the item: a residual store at ``path`` holding the snapshot's contexts, then its
    record of them (keys, each manifest's checksum, the step: ``item_record.py``), complete and
    durable when this returns.

    Runs in the step's commit, inside the folders Orbax renames into place once every item is
    written: a committed item is recorded, whatever happens after. Every process of a multi-host
    job runs it (the store's collective writes make one store of their puts, process 0 committing
    each manifest once all are written); the primary process, which holds every manifest once
    its flush returns, writes the record.
    """
    with Store(path) as store:
        for key, ctx in snapshot.contexts.items():
            store.put(ctx, key)
        store.flush()
    if ocp.multihost.is_primary_host(0):
        item_record.seal(DiskTier(path, create=False), list(snapshot.contexts), snapshot.step)


class ContextsHandler(ocp.AsyncCheckpointHandler):
    """The Orbax handler of :class:`ContextsSave` and :class:`ContextsRestore`: an item that is a
    residual store.

    ``async_save`` copies the contexts to host memory before it returns (Orbax's blocking part)
    and writes the store in a commit future, after Orbax created the item's folder; Orbax
    finalizes the step once every item's futures are done.
    """

    async def async_save(self, directory: epath.Path, args: ContextsSave) -> list[ocp.future.Future]:
        """Copies the contexts, then returns the future of their write (run once Orbax has
        created ``directory``, which may not exist yet).

        A copy that fails (an array deleted since ``ContextsSave`` checked it, a damaged context
        in a store saved, a folder no store opens) fails the future, not this call: Orbax has
        begun the step (its folders are being made, other items saved), and an error here would
        leave that work waiting for signals that never come; the future's error fails the step
        cleanly, from ``wait_until_finished`` or the next ``save``.
        """
        try:
            prepared: tuple[str | dict[str, str], _Snapshot] | Exception = (
                _store_path(directory), _snapshot(args.contexts, _step_folder(directory))
            )
        except Exception as err:  # noqa: BLE001 - raised by the future, below
            prepared = err

        async def commit() -> None:
            if isinstance(prepared, Exception):
                raise prepared
            _write(*prepared)

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name="residual_store_contexts_save")]

    def save(self, directory: epath.Path, args: ContextsSave) -> None:
        """Saves and waits for the write (Orbax's synchronous checkpointers)."""
        _write(_store_path(directory), _snapshot(args.contexts, _step_folder(directory)))

    def restore(self, directory: epath.Path, args: ContextsRestore | None = None) -> Store:
        """A read-only ``rs.Store`` on the item (close it, or use it as a context manager), once
        the item is found to hold what its save recorded: the step's own contexts, every one,
        each with the manifest it was saved with (their arrays are checked on ``get``).

        Raises:
          CorruptContextError: the item is not a whole store, its record is missing or another
            step's, or it lost, gained or changed contexts since its save (each named). An item
            saved by a residual-store before records is restored unchecked, with a warning.
        """
        del args
        path, step = _store_path(directory), _step_folder(directory)
        try:
            store = Store(path, read_only=True)
        except (StoreNotFoundError, CorruptContextError) as err:  # no marker, or a damaged one
            raise CorruptContextError(
                f"the contexts item of step {step!r} is not a whole residual store ({err}): the step "
                "was partly deleted (a crash while max_to_keep removed it?) or the item damaged; "
                "restore another step"
            ) from err
        try:
            item_record.check_item(DiskTier(path, read_only=True), step)
        except BaseException:
            store.close()
            raise
        return store


@ocp.args.register_with_handler(ContextsHandler, for_save=True)
@dataclasses.dataclass
class ContextsSave(ocp.args.CheckpointArgs):
    """Saves residual contexts as an item of an Orbax checkpoint step.

    Args:
      contexts: a mapping from key to ``rs.ResidualContext``, or an ``rs.Store`` (all its keys).
        Checked here: a value that is not a context, or one whose arrays were deleted, raises
        :class:`rs.InvalidArgumentError`, a key outside the store's rules
        :class:`rs.InvalidKeyError`, before anything is written.

    ``CheckpointManager.save`` copies the contexts to host memory before it returns; the item is
    written in the background and committed with the step.

    Example:
      >>> import orbax.checkpoint as ocp, jax.numpy as jnp, residual_store as rs
      >>> from residual_store import orbax as rso
      >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.ones(3))
      >>> args = ocp.args.Composite(contexts=rso.ContextsSave({"mb0": ctx}))
    """

    # (not frozen: a frozen dataclass cannot extend Orbax's CheckpointArgs, which is not)
    contexts: Contexts

    def __post_init__(self) -> None:
        _check_contexts(self.contexts)


@ocp.args.register_with_handler(ContextsHandler, for_restore=True)
@dataclasses.dataclass
class ContextsRestore(ocp.args.CheckpointArgs):
    """Restores a :class:`ContextsSave` item as a read-only ``rs.Store`` on the item's folder,
    once the item is found to hold what its save recorded: :class:`rs.CorruptContextError`
    otherwise, naming each context missing, foreign or changed, or the step it was saved in.

    Example:
      >>> import orbax.checkpoint as ocp
      >>> from residual_store import orbax as rso
      >>> args = ocp.args.Composite(contexts=rso.ContextsRestore())
    """
