//! What the index did with one endpoint's events, for metrics.

/// Counts since the endpoint was first seen; `blocks` and `block_size` are its state now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointStats {
    /// Blocks indexed now.
    pub blocks: usize,
    /// The engine's block size, from its events.
    pub block_size: Option<u32>,
    /// Blocks indexed (a new copy of a block already indexed is not counted).
    pub stored: u64,
    /// Block copies the engine reported evicted.
    pub removed: u64,
    /// Blocks dropped, oldest first, to stay under the per-endpoint cap.
    pub evicted: u64,
    /// Blocks that could not be placed: their parent is not indexed (it came before the
    /// router's window, was dropped at the cap, or was itself not placed).
    pub unplaced: u64,
    /// Blocks that do not take part in prefix matching: other KV groups of a hybrid model,
    /// extra cache keys (multimodal, `cache_salt`) a request's tokens cannot reproduce, and
    /// partial pages shorter than the block size.
    pub skipped: u64,
    /// Times the endpoint's blocks were all dropped (`AllBlocksCleared`, a clear from the
    /// subscriber, a change of block size).
    pub clears: u64,
}
