"""An AVL tree: a binary search tree that stays balanced, used as an ordered map.

Every operation is O(log n) because the heights of any node's two subtrees
differ by at most one. Rotations restore that after an insert or delete.
"""

from collections.abc import Iterator
from typing import Any

_MISSING = object()


class _Node:
    __slots__ = ("height", "key", "left", "right", "value")

    def __init__(self, key: Any, value: Any):
        self.key = key
        self.value = value
        self.left: _Node | None = None
        self.right: _Node | None = None
        self.height = 1


def _height(node: _Node | None) -> int:
    return node.height if node else 0


def _update_height(node: _Node) -> None:
    node.height = 1 + max(_height(node.left), _height(node.right))


def _balance_factor(node: _Node) -> int:
    return _height(node.left) - _height(node.right)


def _rotate_right(node: _Node) -> _Node:
    pivot = node.left
    node.left = pivot.right
    pivot.right = node
    _update_height(node)
    _update_height(pivot)
    return pivot


def _rotate_left(node: _Node) -> _Node:
    pivot = node.right
    node.right = pivot.left
    pivot.left = node
    _update_height(node)
    _update_height(pivot)
    return pivot


def _rebalance(node: _Node) -> _Node:
    _update_height(node)
    balance = _balance_factor(node)
    if balance > 1:
        if _balance_factor(node.left) < 0:
            node.left = _rotate_left(node.left)
        return _rotate_right(node)
    if balance < -1:
        if _balance_factor(node.right) > 0:
            node.right = _rotate_right(node.right)
        return _rotate_left(node)
    return node


class AVLTree:
    """An ordered map from comparable keys to values.

    Invariants: an in-order walk visits keys in increasing order; for every
    node, ``height`` is one more than its taller child's and the children's
    heights differ by at most one.
    """

    def __init__(self, items=()):
        self._root: _Node | None = None
        self._size = 0
        for key, value in items:
            self[key] = value

    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: Any) -> bool:
        return self._find(key) is not None

    def __getitem__(self, key: Any) -> Any:
        node = self._find(key)
        if node is None:
            raise KeyError(key)
        return node.value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._root = self._insert(self._root, key, value)

    def __delitem__(self, key: Any) -> None:
        if self._find(key) is None:
            raise KeyError(key)
        self._root = self._delete(self._root, key)
        self._size -= 1

    def __iter__(self) -> Iterator:
        for key, _ in self.items():
            yield key

    def get(self, key: Any, default: Any = None) -> Any:
        node = self._find(key)
        return default if node is None else node.value

    def height(self) -> int:
        return _height(self._root)

    def items(self) -> Iterator[tuple[Any, Any]]:
        """Yield (key, value) pairs in key order, without recursion."""
        stack: list[_Node] = []
        node = self._root
        while stack or node:
            while node:
                stack.append(node)
                node = node.left
            node = stack.pop()
            yield node.key, node.value
            node = node.right

    def min(self) -> Any:
        node = self._root
        if node is None:
            raise ValueError("min() of an empty tree")
        while node.left:
            node = node.left
        return node.key

    def max(self) -> Any:
        node = self._root
        if node is None:
            raise ValueError("max() of an empty tree")
        while node.right:
            node = node.right
        return node.key

    def floor(self, key: Any, default: Any = _MISSING) -> Any:
        """Return the largest key <= ``key``."""
        best = _MISSING
        node = self._root
        while node:
            if node.key == key:
                return node.key
            if node.key < key:
                best = node.key
                node = node.right
            else:
                node = node.left
        return self._found_or_default(best, default, key, "floor")

    def ceiling(self, key: Any, default: Any = _MISSING) -> Any:
        """Return the smallest key >= ``key``."""
        best = _MISSING
        node = self._root
        while node:
            if node.key == key:
                return node.key
            if node.key > key:
                best = node.key
                node = node.left
            else:
                node = node.right
        return self._found_or_default(best, default, key, "ceiling")

    @staticmethod
    def _found_or_default(best: Any, default: Any, key: Any, what: str) -> Any:
        if best is not _MISSING:
            return best
        if default is _MISSING:
            raise KeyError(f"no {what} for {key!r}")
        return default

    def _find(self, key: Any) -> _Node | None:
        node = self._root
        while node:
            if key == node.key:
                return node
            node = node.left if key < node.key else node.right
        return None

    def _insert(self, node: _Node | None, key: Any, value: Any) -> _Node:
        if node is None:
            self._size += 1
            return _Node(key, value)
        if key == node.key:
            node.value = value
            return node
        if key < node.key:
            node.left = self._insert(node.left, key, value)
        else:
            node.right = self._insert(node.right, key, value)
        return _rebalance(node)

    def _delete(self, node: _Node | None, key: Any) -> _Node | None:
        if node is None:
            return None
        if key < node.key:
            node.left = self._delete(node.left, key)
        elif key > node.key:
            node.right = self._delete(node.right, key)
        else:
            if node.left is None:
                return node.right
            if node.right is None:
                return node.left
            successor = node.right
            while successor.left:
                successor = successor.left
            node.key = successor.key
            node.value = successor.value
            node.right = self._delete(node.right, successor.key)
        return _rebalance(node)
