"""One pytree namespace for fspec: frozen dataclasses seen alike by optree, torch.func and torch.compile.

`@pytree_dataclass` turns a class into a frozen dataclass and registers it twice, with plain functions:

* with `torch.utils._pytree` (what `torch.compile`, `torch.func.vmap` and `torch.func.grad` walk), with
  `flatten_with_keys_fn` and a `serialized_type_name`;
* with optree under the namespace ``"fspec"`` (what `fspec.tree` walks).

`optree.register_pytree_node_class` breaks dynamo graphs and types known only to optree fail under
`torch.func.vmap` (measured on torch 2.13), hence the double registration with plain functions.

Fields marked ``static_field()`` are not leaves: they travel in the tree's structure (auxiliary data), must be
hashable, and a change of their value means a different tree (and a recompile under `torch.compile`).
Children are flattened in field-declaration order by both registries, so both give the same leaves in the same
order. Never put ``None`` in a leaf field: optree treats ``None`` as an empty node and torch as a leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, TypeVar

import optree
import torch.utils._pytree as torch_pytree

NAMESPACE = "fspec"

_T = TypeVar("_T", bound=type)


def static_field(**kwargs: Any) -> Any:
    """A dataclass field kept in the tree structure instead of the leaves (hashable Python values)."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata["static"] = True
    return dataclasses.field(metadata=metadata, **kwargs)


def _split_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    fields = dataclasses.fields(cls)
    children = tuple(f.name for f in fields if not f.metadata.get("static", False))
    static = tuple(f.name for f in fields if f.metadata.get("static", False))
    return children, static


def pytree_dataclass(cls: _T) -> _T:
    """Make `cls` a frozen dataclass registered with optree (namespace "fspec") and `torch.utils._pytree`."""
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    children, static = _split_fields(cls)

    def flatten(obj):
        return [getattr(obj, n) for n in children], tuple(getattr(obj, n) for n in static)

    def unflatten(values, context):
        kwargs = dict(zip(children, values))
        kwargs.update(zip(static, context))
        return cls(**kwargs)

    def flatten_with_keys(obj):
        values, context = flatten(obj)
        return [(torch_pytree.GetAttrKey(n), v) for n, v in zip(children, values)], context

    torch_pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )

    def optree_flatten(obj):
        values, context = flatten(obj)
        return values, context, children

    def optree_unflatten(context, values):
        return unflatten(list(values), context)

    optree.register_pytree_node(cls, optree_flatten, optree_unflatten, namespace=NAMESPACE)
    cls.__fspec_children__ = children
    cls.__fspec_static__ = static
    return cls


def replace(obj: Any, **changes: Any) -> Any:
    """`dataclasses.replace`, the one way to update a state (traceable by dynamo)."""
    return dataclasses.replace(obj, **changes)


def _with_namespace(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        kwargs.setdefault("namespace", NAMESPACE)
        return fn(*args, **kwargs)

    return wrapped


_TREE_FUNCTIONS = (
    "tree_map",
    "tree_map_",
    "tree_map_with_path",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_unflatten",
    "tree_leaves",
    "tree_structure",
    "tree_paths",
    "tree_all",
    "tree_any",
    "tree_reduce",
    "tree_sum",
    "tree_replace_nones",
)

#: optree's tree functions with ``namespace="fspec"`` applied; exported as `fspec.tree`.
tree = types.ModuleType("fspec.tree", "optree's tree functions with namespace='fspec' applied.")
for _name in _TREE_FUNCTIONS:
    if hasattr(optree, _name):
        setattr(tree, _name, _with_namespace(getattr(optree, _name)))
tree.tree_unflatten = optree.tree_unflatten  # a treespec already knows its namespace
tree.NAMESPACE = NAMESPACE
