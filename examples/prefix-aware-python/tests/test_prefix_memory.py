"""Native tests of the policy's pure-Python parts: `python3 -m unittest discover -s
examples/prefix-aware-python/tests`. The component as a whole is tested by the host
(`cargo test -p switchyard --test examples`)."""

import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from prefix_memory import Pending, PrefixMemory, page_hashes  # noqa: E402


class PageHashesTest(unittest.TestCase):
    def test_only_full_pages_up_to_the_limit_are_hashed(self):
        self.assertEqual(len(page_hashes(list(range(15)), 16, 4)), 0)
        self.assertEqual(len(page_hashes(list(range(40)), 16, 4)), 2)
        self.assertEqual(len(page_hashes(list(range(1000)), 16, 4)), 4)

    def test_shared_pages_share_hashes_and_the_rest_differ(self):
        a = page_hashes(list(range(64)), 16, 4)
        b = page_hashes(list(range(32)) + [7] * 32, 16, 4)
        self.assertEqual(a[:2], b[:2])
        self.assertNotEqual(a[2], b[2])
        self.assertNotEqual(a[3], b[3])

    def test_a_page_hash_depends_on_the_pages_before_it(self):
        a = page_hashes([1] * 16 + [2] * 16, 16, 2)
        b = page_hashes([3] * 16 + [2] * 16, 16, 2)
        self.assertNotEqual(a[1], b[1])


class PrefixMemoryTest(unittest.TestCase):
    def test_longest_remembered_prefix_wins(self):
        memory = PrefixMemory(16)
        short, long_ = page_hashes(list(range(64)), 16, 4)[:1], page_hashes(list(range(64)), 16, 4)
        memory.remember(short, 1)
        memory.remember(long_[1:], 2)
        self.assertEqual(memory.lookup(long_), 2)
        self.assertEqual(memory.lookup(long_[:1]), 1)
        self.assertIsNone(memory.lookup([]))

    def test_capacity_evicts_the_least_recently_used(self):
        memory = PrefixMemory(2)
        memory.remember([1], 10)
        memory.remember([2], 20)
        self.assertEqual(memory.lookup([1]), 10)  # 1 is now the most recently used
        memory.remember([3], 30)
        self.assertEqual(len(memory), 2)
        self.assertIsNone(memory.lookup([2]))
        self.assertEqual(memory.lookup([1]), 10)

    def test_forget_only_drops_entries_of_that_endpoint(self):
        memory = PrefixMemory(8)
        memory.remember([1, 2], 5)
        memory.remember([3], 6)
        memory.forget([1, 2, 3], 5)
        self.assertIsNone(memory.lookup([1, 2]))
        self.assertEqual(memory.lookup([3]), 6)


class PendingTest(unittest.TestCase):
    def test_take_returns_once_and_capacity_bounds(self):
        pending = Pending(2)
        pending.put(1, [11])
        pending.put(2, [22])
        pending.put(3, [33])
        self.assertEqual(len(pending), 2)
        self.assertEqual(pending.take(1), [])
        self.assertEqual(pending.take(3), [33])
        self.assertEqual(pending.take(3), [])


if __name__ == "__main__":
    unittest.main()
