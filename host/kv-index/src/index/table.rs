//! [`Table`]: a `u64 → u64` map laid out for probes that miss every cache, as the index's do
//! (its maps are hundreds of megabytes, probed at random).
//!
//! Open addressing in cache lines of four entries, keys and values apart inside the line. A
//! key's search starts at the first entry of its home line and walks on entry by entry (linear
//! probing). Each run of taken entries is kept in order of the keys' spread bits, of which the
//! home line is the top (Robin Hood, ordered): a search ends at the first key ordered after
//! its own, and at most 7/8 of the entries are taken, so nearly every search, for a key there
//! or not, ends in its home line. One cache line, one miss, where a SwissTable reads a control
//! group and then an entry in another line. Removal shifts the rest of the run back (no
//! tombstones), so a table that sees as many removals as inserts, as an index at its cap does,
//! never needs rebuilding; and growing, the order already right, moves runs without a search.
//!
//! Key 0 marks an empty entry; a map holding key 0 keeps its value beside the lines.

/// Entries in one cache line.
const LANES: usize = 4;

const EMPTY: u64 = 0;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line {
    keys: [u64; LANES],
    values: [u64; LANES],
}

const EMPTY_LINE: Line = Line {
    keys: [EMPTY; LANES],
    values: [0; LANES],
};

#[derive(Default)]
pub(super) struct Table {
    /// A power of two of them, or none before the first insert.
    lines: Vec<Line>,
    /// Keys in `lines`.
    len: usize,
    /// Key 0's value, which `lines` cannot hold.
    zero: Option<u64>,
}

/// Where a search for a key ended, as a position among all entries (line × [`LANES`] + lane).
enum Search {
    Found(usize),
    /// Not there; where it goes, the rest of the run moving one entry on.
    Absent(usize),
}

impl Table {
    pub(super) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.lines.capacity() * size_of::<Line>()
    }

    /// `key`'s value. Reads the home line without a branch on what it holds, so the searches
    /// of consecutive calls go to memory together instead of waiting on each other's misses.
    // Into the walk, which calls it once a block: the call showed (2 of a lookup's 34 µs).
    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<u64> {
        if key == EMPTY {
            return self.zero;
        }
        let home = self.home(key);
        let mut line = home;
        for _ in 0..self.lines.len() {
            let Line { keys, values } = &self.lines[line];
            let (mut value, mut found, mut open) = (0, false, false);
            for lane in 0..LANES {
                let hit = keys[lane] == key;
                // Which lane holds the key is random: a branch on it would mispredict.
                value |= std::hint::select_unpredictable(hit, values[lane], 0);
                found |= hit;
                open |= keys[lane] == EMPTY;
            }
            if found || open || self.homed_past(keys[LANES - 1], home, line) {
                return found.then_some(value);
            }
            line = (line + 1) & (self.lines.len() - 1);
        }
        None
    }

    /// Reads the home line of each key and nothing else, so that their cache misses are all
    /// in flight together before the searches that need them. A stand-in for a prefetch,
    /// which safe Rust cannot issue: each read holds the CPU's reorder window until its line
    /// arrives, so reads this small let the most of them wait at once.
    pub(super) fn touch(&self, keys: impl IntoIterator<Item = u64>) {
        self.touch_lines(keys, 1);
    }

    /// [`Self::touch`] for keys about to be inserted or removed: the home line and the next,
    /// into which the shift of the rest of the run often goes on.
    pub(super) fn touch_for_update(&self, keys: impl IntoIterator<Item = u64>) {
        self.touch_lines(keys, 2);
    }

    fn touch_lines(&self, keys: impl IntoIterator<Item = u64>, lines: usize) {
        if self.lines.is_empty() {
            return;
        }
        let mut any = 0;
        for key in keys {
            let home = self.home(key);
            for line in home..home + lines {
                any ^= self.lines[line & (self.lines.len() - 1)].keys[0];
            }
        }
        std::hint::black_box(any);
    }

    pub(super) fn get_mut(&mut self, key: u64) -> Option<&mut u64> {
        if key == EMPTY {
            return self.zero.as_mut();
        }
        match self.search(key) {
            Some(Search::Found(entry)) => Some(self.value_mut(entry)),
            _ => None,
        }
    }

    /// Sets `key`'s value, returning the one it replaces.
    pub(super) fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        if key == EMPTY {
            return self.zero.replace(value);
        }
        let at = match self.search(key) {
            Some(Search::Found(entry)) => {
                return Some(std::mem::replace(self.value_mut(entry), value));
            }
            Some(Search::Absent(entry)) if (self.len + 1) * 8 <= self.entries() * 7 => entry,
            _ => {
                self.grow();
                self.absent_at(key)
            }
        };
        self.insert_at(at, key, value);
        None
    }

    pub(super) fn remove(&mut self, key: u64) -> Option<u64> {
        if key == EMPTY {
            return self.zero.take();
        }
        let Some(Search::Found(entry)) = self.search(key) else {
            return None;
        };
        let value = *self.value_mut(entry);
        self.shift_back_into(entry);
        self.len -= 1;
        Some(value)
    }

    /// Empties the table, keeping its lines for what comes next.
    pub(super) fn clear(&mut self) {
        self.lines.fill(EMPTY_LINE);
        self.len = 0;
        self.zero = None;
    }

    fn entries(&self) -> usize {
        self.lines.len() * LANES
    }

    /// The line a key's search starts at: the top bits of its [`spread`].
    fn home(&self, key: u64) -> usize {
        home_line(key, self.lines.len())
    }

    /// Whether `other`, a key in `line`, has its home past `home`: runs are in order of home,
    /// so a key homed at `home` would be before it.
    fn homed_past(&self, other: u64, home: usize, line: usize) -> bool {
        let mask = self.lines.len() - 1;
        (line.wrapping_sub(self.home(other)) & mask) < (line.wrapping_sub(home) & mask)
    }

    /// Whether `key`, homed at `home`, goes before `other`, a key in `line`: `other` is homed
    /// past it, or at the same line with greater spread bits.
    fn goes_before(&self, key: u64, home: usize, other: u64, line: usize) -> bool {
        self.homed_past(other, home, line)
            || (self.home(other) == home && spread(key) < spread(other))
    }

    /// `None` when there are no lines yet.
    fn search(&self, key: u64) -> Option<Search> {
        let line_mask = self.lines.len().checked_sub(1)?;
        let home = self.home(key);
        let mut line = home;
        for _ in 0..self.lines.len() {
            let keys = &self.lines[line].keys;
            if let Some(lane) = keys.iter().position(|&other| other == key) {
                return Some(Search::Found(line * LANES + lane));
            }
            if let Some(lane) = keys
                .iter()
                .position(|&other| other == EMPTY || self.goes_before(key, home, other, line))
            {
                return Some(Search::Absent(line * LANES + lane));
            }
            line = (line + 1) & line_mask;
        }
        None
    }

    /// Where `key`, absent, goes.
    fn absent_at(&self, key: u64) -> usize {
        let Some(Search::Absent(entry)) = self.search(key) else {
            unreachable!("the key is absent and the table has lines");
        };
        entry
    }

    /// Puts `key` at `entry`, where its search ended, and each key from there to the end of
    /// the run one entry on: the run stays in order of home.
    fn insert_at(&mut self, mut entry: usize, key: u64, value: u64) {
        let mask = self.entries() - 1;
        let (mut key, mut value) = (key, value);
        for _ in 0..=mask {
            let line = &mut self.lines[entry / LANES];
            key = std::mem::replace(&mut line.keys[entry % LANES], key);
            value = std::mem::replace(&mut line.values[entry % LANES], value);
            if key == EMPTY {
                break;
            }
            entry = (entry + 1) & mask;
        }
        self.len += 1;
    }

    /// Fills the hole at `entry` with the rest of its run, each key one entry back, until a
    /// key already first in its home line or an empty entry (backward-shift deletion).
    fn shift_back_into(&mut self, mut hole: usize) {
        let mask = self.entries() - 1;
        for _ in 0..mask {
            let next = (hole + 1) & mask;
            let key = self.key(next);
            if key == EMPTY || next == self.home(key) * LANES {
                break;
            }
            let value = *self.value_mut(next);
            self.set(hole, key, value);
            hole = next;
        }
        self.set(hole, EMPTY, 0);
    }

    /// Doubles the lines. Runs are in order of spread bits, of which a key's new home takes
    /// one more: taken in that order, each key goes at the end of the new run so far, with no
    /// search and no shift.
    fn grow(&mut self) {
        let lines = (self.lines.len() * 2).max(1);
        let old = std::mem::replace(&mut self.lines, empty_lines(lines));
        let (old_lines, old_entries) = (old.len(), old.len() * LANES);
        let old_key = |entry: usize| old[entry / LANES].keys[entry % LANES];
        // Start after an empty entry: no run goes on past one, so none is cut in two. Homes
        // and positions count on from there without wrapping ("unwrapped").
        let Some(empty) = (0..old_entries).find(|&entry| old_key(entry) == EMPTY) else {
            return;
        };
        let (first_home, mask) = (empty / LANES + 1, lines * LANES - 1);
        let mut next = 0;
        for step in 1..old_entries {
            let entry = (empty + step) & (old_entries - 1);
            let key = old_key(entry);
            if key == EMPTY {
                continue;
            }
            // The new home, unwrapped as the old one (half of it) is.
            let home = home_line(key, lines);
            let home = if home / 2 >= first_home {
                home
            } else {
                home + 2 * old_lines
            };
            let at = (home * LANES).max(next);
            self.set(at & mask, key, old[entry / LANES].values[entry % LANES]);
            next = at + 1;
        }
    }

    fn key(&self, entry: usize) -> u64 {
        self.lines[entry / LANES].keys[entry % LANES]
    }

    fn value_mut(&mut self, entry: usize) -> &mut u64 {
        &mut self.lines[entry / LANES].values[entry % LANES]
    }

    fn set(&mut self, entry: usize, key: u64, value: u64) {
        let line = &mut self.lines[entry / LANES];
        line.keys[entry % LANES] = key;
        line.values[entry % LANES] = value;
    }
}

/// `count` empty lines, on huge pages where the system gives them: the lines are probed at
/// random, and the holders' table is far larger than what 4 KiB pages' translations cover.
fn empty_lines(count: usize) -> Vec<Line> {
    let mut lines = Vec::with_capacity(count);
    // Before the lines are first written: a page is backed when first touched.
    super::huge_pages::advise(lines.spare_capacity_mut());
    lines.resize(count, EMPTY_LINE);
    lines
}

/// A key's bits spread by a multiplication (engine hashes may be small integers): its home
/// line is their top bits, and runs are in their order.
fn spread(key: u64) -> u64 {
    key.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// [`Table::home`] among `lines` lines.
fn home_line(key: u64, lines: usize) -> usize {
    ((u128::from(spread(key)) * lines as u128) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Every key is reachable from its home, runs in order: each entry is at most one further
    /// from its home than the entry before it (at its home after an empty one), and after it
    /// in spread bits when both have the same home.
    fn assert_in_order(table: &Table) {
        let Some(mask) = table.entries().checked_sub(1) else {
            return;
        };
        let distance = |entry: usize, key: u64| entry.wrapping_sub(table.home(key) * LANES) & mask;
        for entry in 0..table.entries() {
            let (key, before) = (table.key(entry), (entry + mask) & mask);
            if key == EMPTY {
                continue;
            }
            match table.key(before) {
                EMPTY => assert_eq!(distance(entry, key), 0, "entry {entry}"),
                other => {
                    assert!(
                        distance(entry, key) <= distance(before, other) + 1,
                        "entry {entry}"
                    );
                    if table.home(other) == table.home(key) {
                        assert!(spread(other) < spread(key), "entry {entry}");
                    }
                }
            }
        }
    }

    /// A line is one cache line, and so is every line of the allocation.
    #[test]
    fn a_line_is_one_aligned_cache_line() {
        assert_eq!((size_of::<Line>(), align_of::<Line>()), (64, 64));
    }

    #[test]
    fn it_grows_keeping_every_key_and_at_most_seven_eighths_full() {
        let mut table = Table::default();
        let key = |i: u64| i.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
        let mut grown = 0;
        for i in 0..10_000u64 {
            let entries = table.entries();
            assert_eq!(table.insert(key(i), i), None);
            assert!(table.len * 8 <= table.entries() * 7, "{i}");
            if table.entries() != entries {
                // Grown by moving runs over without a search: still in order.
                assert_in_order(&table);
                grown += 1;
            }
        }
        assert_eq!(grown, 13, "1 line, then doubled up to 4,096");
        assert_eq!(table.len(), 10_000);
        assert_eq!(
            table.entries(),
            16_384,
            "the smallest power of two that fits"
        );
        assert_in_order(&table);
        for i in 0..10_000u64 {
            assert_eq!(table.get(key(i)), Some(i));
        }
        assert_eq!(table.get(key(10_000)), None);
        assert_eq!(
            table.insert(key(7), 70),
            Some(7),
            "an existing key is replaced"
        );
        assert_eq!(table.len(), 10_000);
    }

    /// Seven keys in two lines, inserted in every kind of order so that runs cross from one
    /// line into the next and wrap from the last line to the first; removals in any order must
    /// leave each remaining key findable (a hole left in a run would hide the keys after it)
    /// and the entries exactly the keys held.
    #[test]
    fn removal_shifts_runs_back_without_hiding_any_key() {
        let two_lines = || {
            let mut table = Table::default();
            table.grow();
            table.grow();
            assert_eq!(table.lines.len(), 2);
            table
        };
        let mut by_home: [Vec<u64>; 2] = Default::default();
        let table = two_lines();
        for candidate in 1.. {
            let home = &mut by_home[table.home(candidate)];
            if home.len() < 5 {
                home.push(candidate);
            }
            if by_home.iter().all(|keys| keys.len() == 5) {
                break;
            }
        }
        let (mut crossed, mut wrapped) = (false, false);
        for seed in 0..60u64 {
            // 2 to 5 keys of line 0, the rest of line 1: one line or the other overflows.
            let first = 2 + seed as usize % 4;
            let keys = shuffled(
                &[&by_home[0][..first], &by_home[1][..7 - first]].concat(),
                seed,
            );
            let mut table = two_lines();
            let mut model = HashMap::new();
            for (i, &key) in keys.iter().enumerate() {
                assert_eq!(table.insert(key, i as u64), None);
                model.insert(key, i as u64);
            }
            assert_eq!(table.lines.len(), 2, "seven keys fit in eight entries");
            crossed |= table.home(table.key(LANES)) == 0;
            wrapped |= table.home(table.key(0)) == 1;
            // Growing moves runs that cross lines and wrap without losing their order.
            let mut grown = two_lines();
            for (i, &key) in keys.iter().enumerate() {
                grown.insert(key, i as u64);
            }
            grown.grow();
            assert_in_order(&grown);
            for (&key, &value) in &model {
                assert_eq!(grown.get(key), Some(value), "seed {seed}");
            }
            for &key in &shuffled(&keys, seed + 1) {
                assert_eq!(table.remove(key), model.remove(&key), "seed {seed}");
                for (&key, &value) in &model {
                    assert_eq!(table.get(key), Some(value), "seed {seed}");
                }
                let mut held: Vec<u64> = (0..table.entries())
                    .map(|entry| table.key(entry))
                    .filter(|&key| key != EMPTY)
                    .collect();
                held.sort_unstable();
                let mut expected: Vec<u64> = model.keys().copied().collect();
                expected.sort_unstable();
                assert_eq!(held, expected, "seed {seed}");
                assert_in_order(&table);
            }
            assert_eq!(table.remove(keys[0]), None);
        }
        assert!(
            crossed && wrapped,
            "the layouts this test is about occurred"
        );
    }

    /// Random inserts, updates and removals against std's map, with the key 0 among them.
    #[test]
    fn it_agrees_with_a_hash_map_under_churn() {
        let mut table = Table::default();
        let mut model = HashMap::new();
        let mut state = 0x1234_5678u64;
        let mut zero_held = 0;
        for step in 0..200_000u64 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            // Few distinct keys, so removals find them; some keys' homes collide.
            let key = (state >> 33) % 3_000;
            match (state >> 20) % 4 {
                0 | 1 => assert_eq!(table.insert(key, step), model.insert(key, step)),
                2 => assert_eq!(table.remove(key), model.remove(&key)),
                _ => {
                    if let Some(value) = table.get_mut(key) {
                        *value += 1;
                    }
                    if let Some(value) = model.get_mut(&key) {
                        *value += 1;
                    }
                }
            }
            assert_eq!(table.get(key), model.get(&key).copied());
            assert_eq!(table.len(), model.len());
            if step % 1_000 == 0 {
                assert_in_order(&table);
            }
            zero_held += usize::from(model.contains_key(&0));
        }
        for (&key, &value) in &model {
            assert_eq!(table.get(key), Some(value));
        }
        assert!(zero_held > 0, "the key 0 took part");
        let entries = table.entries();
        table.clear();
        assert_eq!(
            (table.len(), table.get(0), table.entries()),
            (0, None, entries)
        );
    }

    fn shuffled(keys: &[u64], seed: u64) -> Vec<u64> {
        let mut keys = keys.to_vec();
        let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
        for i in (1..keys.len()).rev() {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            keys.swap(i, (state >> 33) as usize % (i + 1));
        }
        keys
    }
}
