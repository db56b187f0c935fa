"""The rest of ``collections.abc.MutableMapping`` over a store's own verbs.

A :class:`~residual_store.Store` is registered as a ``MutableMapping`` (not derived from one:
``Mapping.__eq__`` would read every context to compare two stores, and would make stores
unhashable). Its own methods are ``get``, ``put``, ``pop``, ``delete``, ``keys``, ``__getitem__``,
``__setitem__``, ``__delitem__``, ``__iter__``, ``__len__`` and ``__contains__``; this mixin spells
the others with them, once: ``items`` and ``values`` (views: each value is a ``get``, made as the
iteration reaches it), ``update``, ``setdefault``, ``popitem`` and ``clear``.

The one difference from a plain mapping is the store's contract for a missing key: ``get(key)``
without a default raises :class:`~residual_store.ContextNotFoundError` (a ``KeyError``), as
``store[key]`` does; ``get(key, None)`` returns ``None``.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView
from typing import TYPE_CHECKING, Any, Protocol

from residual_store._src.errors import ContextNotFoundError, InvalidArgumentError, InvalidKeyError

if TYPE_CHECKING:
    from residual_store._src.context import ResidualContext

__all__ = ["StoreMapping"]


class _Verbs(Protocol):
    """What the mixin spells the rest with: the store's own methods."""

    def keys(self) -> list[str]: ...
    def pop(self, key: str) -> ResidualContext: ...
    def __getitem__(self, key: str) -> ResidualContext: ...
    def __setitem__(self, key: str, ctx: ResidualContext) -> None: ...
    def __delitem__(self, key: str) -> None: ...
    def __iter__(self) -> Iterator[str]: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...


class StoreMapping:
    """The ``MutableMapping`` methods a store spells with its own verbs."""

    def items(self: _Verbs) -> ItemsView[str, ResidualContext]:
        """``(key, context)`` pairs; each context is got (verified, on device) as the iteration
        reaches it, so a store larger than memory can be walked."""
        return ItemsView(self)  # type: ignore[arg-type]

    def values(self: _Verbs) -> ValuesView[ResidualContext]:
        """The contexts, each got as the iteration reaches it (see :meth:`items`)."""
        return ValuesView(self)  # type: ignore[arg-type]

    def update(self: _Verbs, other: Mapping[str, ResidualContext] | Iterable[tuple[str, ResidualContext]] = (),
               /, **contexts: ResidualContext) -> None:
        """Puts every ``key: context`` of ``other`` (a mapping, a store, or pairs) and of
        ``contexts``, as ``dict.update`` does, in their order; what ``dict.update`` refuses
        raises the library's errors (:class:`InvalidArgumentError`, a ``TypeError``, for what is
        not iterable; :class:`InvalidKeyError`, a ``ValueError``, for an item of another length
        than two, or a key that is not a str)."""
        for key, ctx in _pairs(other):  # (each checked by __setitem__ and put)
            self[key] = ctx
        for key, ctx in contexts.items():
            self[key] = ctx

    def setdefault(self: _Verbs, key: str, default: ResidualContext) -> ResidualContext:
        """The context under ``key``; where there is none, puts ``default`` there and returns it."""
        try:
            return self[key]
        except ContextNotFoundError:
            self[key] = default
            return default

    def popitem(self: _Verbs) -> tuple[str, ResidualContext]:
        """Removes one context and returns ``(key, context)`` (the first key, in key order);
        :class:`ContextNotFoundError` only for a store that is empty: a key another thread
        removes meanwhile is passed over, as a dict under a lock would never have shown it."""
        while keys := self.keys():
            for key in keys:
                try:
                    return key, self.pop(key)
                except ContextNotFoundError:
                    continue  # removed meanwhile
        raise ContextNotFoundError(f"popitem: the store {self!r} is empty")

    def clear(self: _Verbs) -> None:
        """Deletes every context (no context is read)."""
        for key in self.keys():
            try:
                del self[key]
            except ContextNotFoundError:
                pass  # removed meanwhile


def _pairs(other: object) -> Iterator[tuple[Any, Any]]:
    """``other``'s ``(key, context)`` pairs, one at a time, as ``dict.update`` takes them: a
    mapping's items (anything with ``keys()``: a store's contexts are got as they come), or an
    iterable of pairs."""
    if isinstance(other, Mapping) or hasattr(other, "keys"):
        for key in other.keys():  # type: ignore[attr-defined]
            yield key, other[key]  # type: ignore[index]
        return
    if not isinstance(other, Iterable):
        raise InvalidArgumentError(
            f"update expects a mapping of key -> context or (key, context) pairs, got {type(other).__name__}"
        )
    for i, item in enumerate(other):  # (the errors dict.update raises: TypeError, then ValueError)
        if not isinstance(item, Iterable):
            raise InvalidArgumentError(f"update: item #{i} is not a (key, context) pair: {item!r:.60}")
        pair = tuple(item)
        if len(pair) != 2:
            raise InvalidKeyError(f"update: item #{i} is not a (key, context) pair: {item!r:.60}")
        yield pair
