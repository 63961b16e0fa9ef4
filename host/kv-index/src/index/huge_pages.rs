//! Huge pages for the index's largest table. A lookup probes the GPU holders (128 MiB at 64
//! endpoints × 100k blocks) at random, and with 4 KiB pages nearly every probe misses the TLB
//! as well as the caches; with 2 MiB pages the whole table's translations fit in the TLB.
//! Linux backs memory with transparent huge pages where a program asks (`madvise`, the
//! default `transparent_hugepage` mode of most distributions); in mode `always` asking changes
//! nothing, in mode `never` it is ignored. Elsewhere, nothing is asked.

use std::mem::MaybeUninit;

/// Asks that `memory`, not touched yet, be backed by huge pages when it is: each whole 2 MiB
/// page inside it (a table of lines smaller than one never asks).
#[cfg(target_os = "linux")]
pub(super) fn advise<T>(memory: &mut [MaybeUninit<T>]) {
    /// The huge page of x86-64, and of aarch64 with 4 KiB pages.
    const HUGE_PAGE: usize = 2 << 20;
    let (start, bytes) = (memory.as_mut_ptr().cast::<u8>(), size_of_val(memory));
    let skip = start.align_offset(HUGE_PAGE);
    let len = bytes.saturating_sub(skip) / HUGE_PAGE * HUGE_PAGE;
    if len == 0 {
        return;
    }
    // SAFETY: the range lies inside `memory`, borrowed mutably here, and `MADV_HUGEPAGE` only
    // changes which pages the kernel backs it with, never what it holds or whether it is
    // mapped. A kernel without huge pages refuses (EINVAL): the advice is only advice.
    #[expect(
        unsafe_code,
        reason = "madvise, the only way to ask for huge pages; audited above"
    )]
    let _ = unsafe { libc::madvise(start.wrapping_add(skip).cast(), len, libc::MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
pub(super) fn advise<T>(_memory: &mut [MaybeUninit<T>]) {}
