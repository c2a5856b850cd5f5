"""sortedkit: ordered container types in pure Python."""

from sortedkit.avl import AVLTree
from sortedkit.heap import IndexedHeap
from sortedkit.intervals import IntervalSet
from sortedkit.lru import LRUCache
from sortedkit.sorteddict import SortedDict
from sortedkit.sortedlist import SortedList

__all__ = ["AVLTree", "IndexedHeap", "IntervalSet", "LRUCache", "SortedDict", "SortedList"]
