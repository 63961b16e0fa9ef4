//! A generation's text as it streams: token bytes become UTF-8 text only whole characters at a
//! time, stop strings end it, and text that may still turn out to be a stop string's start is
//! held back. Each chunk names the generated ids whose text it completes.

use std::collections::VecDeque;

use super::request::Event;

/// The streamed text of one generation and what of it is not sent yet.
#[derive(Debug)]
pub(super) struct TextStream {
    stop: Vec<String>,
    /// Bytes of generated tokens not yet valid UTF-8 (a character split across tokens).
    pending: Vec<u8>,
    text: String,
    /// Bytes of `text` sent so far.
    emitted: usize,
    /// Generated tokens not yet sent.
    unsent: VecDeque<Unsent>,
}

/// A generated token not sent yet, with the text length that covers it (`usize::MAX` while its
/// bytes are still pending).
#[derive(Debug)]
struct Unsent {
    id: u32,
    logprob: Option<f32>,
    covered: usize,
}

impl TextStream {
    pub(super) fn new(stop: Vec<String>) -> Self {
        TextStream {
            stop,
            pending: Vec::new(),
            text: String::new(),
            emitted: 0,
            unsent: VecDeque::new(),
        }
    }

    /// Appends token `id`, which stands for `bytes`. `true` when the text now holds a stop
    /// string: it is cut before the match, and the generation is over.
    pub(super) fn push(&mut self, id: u32, bytes: &[u8], logprob: Option<f32>) -> bool {
        let before = self.text.len();
        self.pending.extend_from_slice(bytes);
        decode_pending(&mut self.pending, &mut self.text, false);
        self.unsent.push_back(Unsent {
            id,
            logprob,
            covered: usize::MAX,
        });
        if self.pending.is_empty() {
            let covered = self.text.len();
            for unsent in self.unsent.iter_mut().rev() {
                if unsent.covered != usize::MAX {
                    break;
                }
                unsent.covered = covered;
            }
        }
        match first_stop_match(&self.text, &self.stop, self.text.len() - before) {
            Some(at) => {
                self.text.truncate(at);
                true
            }
            None => false,
        }
    }

    /// What can be sent now, as an event without a finish: text that can no longer turn out to
    /// be the start of a stop string, and the ids (with their log-probabilities) whose text that
    /// completes. At the `end` of the generation, everything: an unfinished character becomes
    /// U+FFFD and every id not sent yet goes with it.
    pub(super) fn take(&mut self, end: bool) -> Event {
        if end {
            decode_pending(&mut self.pending, &mut self.text, true);
        }
        let bytes = self.text.as_bytes();
        let mut safe = bytes.len();
        if !end {
            for start in self.emitted..bytes.len() {
                let tail = &bytes[start..];
                if self
                    .stop
                    .iter()
                    .any(|s| s.len() > tail.len() && s.as_bytes().starts_with(tail))
                {
                    safe = start;
                    break;
                }
            }
        }
        let safe = safe.max(self.emitted);
        let text = self
            .text
            .get(self.emitted..safe)
            .unwrap_or_default()
            .to_owned();
        self.emitted = safe;
        let sent = if end {
            self.unsent.len()
        } else {
            self.unsent.iter().take_while(|u| u.covered <= safe).count()
        };
        let mut token_ids = Vec::with_capacity(sent);
        let mut logprobs = Vec::new();
        for unsent in self.unsent.drain(..sent) {
            token_ids.push(unsent.id);
            logprobs.extend(unsent.logprob);
        }
        Event {
            text,
            token_ids,
            logprobs,
            finish: None,
        }
    }
}

/// Byte offset of the earliest stop string in `text`, which had none before its last `added`
/// bytes: a match must end in them, so only that tail is searched (a long generation with stop
/// strings stays linear).
fn first_stop_match(text: &str, stops: &[String], added: usize) -> Option<usize> {
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    let mut start = text.len().saturating_sub(added + longest.saturating_sub(1));
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text[start..].find(s.as_str()))
        .min()
        .map(|at| start + at)
}

/// Moves the complete UTF-8 characters at the front of `pending` into `text`, so a streamed
/// chunk never carries half a character; bytes that can never become valid are replaced by
/// U+FFFD, and so is an unfinished character when `flush` (the generation ended).
fn decode_pending(pending: &mut Vec<u8>, text: &mut String, flush: bool) {
    let mut rest = pending.as_slice();
    loop {
        match std::str::from_utf8(rest) {
            Ok(valid) => {
                text.push_str(valid);
                rest = &[];
                break;
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                text.push_str(std::str::from_utf8(valid).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        text.push(char::REPLACEMENT_CHARACTER);
                        rest = &after[bad..];
                    }
                    None if flush => {
                        text.push(char::REPLACEMENT_CHARACTER);
                        rest = &[];
                        break;
                    }
                    None => {
                        rest = after;
                        break;
                    }
                }
            }
        }
    }
    let keep = rest.len();
    pending.drain(..pending.len() - keep);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_search_finds_what_a_full_search_finds() {
        let stops = vec!["cab".to_owned(), "é!".to_owned(), "zz".to_owned()];
        let text = "abcaé!xcabzz";
        let mut grown = String::new();
        let mut found = None;
        for ch in text.chars() {
            grown.push(ch);
            found = first_stop_match(&grown, &stops, ch.len_utf8());
            if found.is_some() {
                break;
            }
        }
        let full = stops.iter().filter_map(|s| grown.find(s.as_str())).min();
        assert_eq!(found, full);
        assert_eq!(&grown[found.unwrap()..], "é!");
    }

    #[test]
    fn a_character_split_across_tokens_is_streamed_whole() {
        let mut pending = Vec::new();
        let mut text = String::new();
        let mut seen = Vec::new();
        for &b in "é🦀x".as_bytes() {
            pending.push(b);
            decode_pending(&mut pending, &mut text, false);
            seen.push(text.clone());
        }
        assert_eq!(seen, ["", "é", "é", "é", "é", "é🦀", "é🦀x"]);
        // Bytes that can never be valid are replaced at once; an unfinished character only when
        // the generation ends.
        pending.extend_from_slice(&[0xFF, b'a', 0xF0, 0x9F]);
        decode_pending(&mut pending, &mut text, false);
        assert_eq!(text, "é🦀x\u{FFFD}a");
        assert_eq!(pending, [0xF0, 0x9F]);
        decode_pending(&mut pending, &mut text, true);
        assert_eq!(text, "é🦀x\u{FFFD}a\u{FFFD}");
        assert!(pending.is_empty());
    }
}
