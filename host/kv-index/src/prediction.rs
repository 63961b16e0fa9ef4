//! How the index's prediction is checked against what an engine then reports.

/// Whether `predicted`, the cached prefix the index gave for a `prompt_len`-token prompt, is
/// what the engine then reported having served from cache: `cached` rounded down to whole
/// `block_size`-token blocks (an engine may count tokens of a partial block that no event
/// announces). An engine computes the prompt's last token itself (vLLM, SGLang, the reference
/// engine), so it reports at most the whole blocks before it: a prediction of more counts as
/// that much. The router's `switchyard_kv_prediction_hits_total` and the lab's
/// `prefix_prediction_accuracy` both count by this rule.
pub fn prediction_hit(
    predicted: usize,
    cached: usize,
    prompt_len: usize,
    block_size: usize,
) -> bool {
    let whole_blocks = |tokens: usize| tokens - tokens % block_size.max(1);
    let reportable = whole_blocks(prompt_len.saturating_sub(1));
    predicted.min(reportable) == whole_blocks(cached)
}

#[cfg(test)]
mod tests {
    use super::prediction_hit;

    #[test]
    fn a_prediction_hits_when_it_is_the_reported_tokens_in_whole_blocks() {
        // 15 cached tokens of 16-token blocks: no whole block, as predicted.
        assert!(prediction_hit(0, 15, 40, 16));
        assert!(!prediction_hit(0, 16, 40, 16));
        assert!(prediction_hit(16, 31, 40, 16));
        // A 32-token prompt: the engine computes token 32 itself, so it reports at most one
        // block; a prediction of both counts as one.
        assert!(prediction_hit(32, 16, 32, 16));
        assert!(!prediction_hit(32, 0, 32, 16));
        // A block size of 0 (no event yet) counts tokens as they are.
        assert!(prediction_hit(5, 5, 40, 0));
    }
}
