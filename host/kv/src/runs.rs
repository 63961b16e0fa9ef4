//! Turning scattered slot lists into few, large contiguous copies.

use super::SlotRun;

/// One contiguous copy: `len` slots from `src..` in our pool to `dst..` in the peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyRun {
    pub src: u32,
    pub dst: u32,
    pub len: u32,
}

/// Pairs `src[i]` with the i-th destination slot and merges pairs that are adjacent on *both*
/// sides, so each copy is as long as the two layouts allow. The caller checks the lengths match.
pub(crate) fn common_runs(src: &[u32], dst: impl IntoIterator<Item = u32>) -> Vec<CopyRun> {
    let mut runs: Vec<CopyRun> = Vec::new();
    for (&s, d) in src.iter().zip(dst) {
        match runs.last_mut() {
            Some(last)
                if last.src.checked_add(last.len) == Some(s)
                    && last.dst.checked_add(last.len) == Some(d) =>
            {
                last.len += 1;
            }
            _ => runs.push(CopyRun {
                src: s,
                dst: d,
                len: 1,
            }),
        }
    }
    runs
}

/// Merges adjacent slots of one layout into runs, keeping order.
pub(crate) fn merge_slots(slots: impl IntoIterator<Item = u32>) -> Vec<SlotRun> {
    let mut runs: Vec<SlotRun> = Vec::new();
    for slot in slots {
        match runs.last_mut() {
            Some(last) if last.begin.checked_add(last.len) == Some(slot) => last.len += 1,
            _ => runs.push(SlotRun {
                begin: slot,
                len: 1,
            }),
        }
    }
    runs
}

/// The first slot of `runs` that is not below `num_slots`, if any.
pub(crate) fn first_out_of_range(runs: &[SlotRun], num_slots: u32) -> Option<u32> {
    runs.iter()
        .find(|r| u64::from(r.begin) + u64::from(r.len) > u64::from(num_slots))
        .map(|r| r.begin.max(num_slots))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn merges_only_where_both_sides_are_adjacent() {
        let runs = common_runs(&[0, 1, 2, 3, 10, 11], [100, 101, 50, 51, 52, 53]);
        assert_eq!(
            runs,
            vec![
                CopyRun {
                    src: 0,
                    dst: 100,
                    len: 2
                },
                CopyRun {
                    src: 2,
                    dst: 50,
                    len: 2
                },
                CopyRun {
                    src: 10,
                    dst: 52,
                    len: 2
                },
            ]
        );
    }

    #[test]
    fn does_not_merge_across_u32_max() {
        let runs = merge_slots([u32::MAX, 0]);
        assert_eq!(runs.len(), 2);
    }

    #[test]
    fn finds_out_of_range_slots() {
        let runs = [SlotRun { begin: 0, len: 4 }, SlotRun { begin: 6, len: 4 }];
        assert_eq!(first_out_of_range(&runs, 10), None);
        assert_eq!(first_out_of_range(&runs, 9), Some(9));
        assert_eq!(
            first_out_of_range(&[SlotRun { begin: 12, len: 1 }], 9),
            Some(12)
        );
    }

    proptest! {
        #[test]
        fn common_runs_expand_to_the_same_pairs(
            pairs in prop::collection::vec((0u32..64, 0u32..64), 0..64)
        ) {
            let (src, dst): (Vec<u32>, Vec<u32>) = pairs.into_iter().unzip();
            let expanded: Vec<(u32, u32)> = common_runs(&src, dst.iter().copied())
                .into_iter()
                .flat_map(|r| (0..r.len).map(move |i| (r.src + i, r.dst + i)))
                .collect();
            prop_assert_eq!(expanded, src.into_iter().zip(dst).collect::<Vec<_>>());
        }

        #[test]
        fn merge_slots_expands_to_the_same_slots(slots in prop::collection::vec(0u32..32, 0..64)) {
            let expanded: Vec<u32> = merge_slots(slots.iter().copied())
                .iter()
                .flat_map(SlotRun::slots)
                .collect();
            prop_assert_eq!(expanded, slots);
        }
    }
}
