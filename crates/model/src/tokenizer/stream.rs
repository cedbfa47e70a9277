//! Streaming detokenization: feed ids one at a time, get back only complete UTF-8 text.
//!
//! For tokenizers with exact per-token bytes (tiktoken, byte-level BPE) the decoder keeps a byte buffer and emits
//! its longest valid UTF-8 prefix; a byte sequence that can never become valid is emitted as U+FFFD right away,
//! exactly as `String::from_utf8_lossy` would replace it in the whole output, so the concatenated stream equals
//! `decode(all ids)`. Other tokenizers (SentencePiece-style) re-decode a short window and emit the new suffix once
//! it no longer ends in U+FFFD (the approach of text-generation-inference).

use std::ops::Deref;

use super::Tokenizer;
use super::error::Result;

/// Incremental decoder over a tokenizer (`&Tokenizer`, `Arc<Tokenizer>`, ...).
#[derive(Debug)]
pub struct StreamDecoder<T: Deref<Target = Tokenizer>> {
    tokenizer: T,
    skip_special: bool,
    /// Bytes not yet emitted (an incomplete UTF-8 sequence at most 3 bytes long, in bytes mode).
    pending: Vec<u8>,
    /// Window of ids for the re-decoding mode.
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl<T: Deref<Target = Tokenizer>> StreamDecoder<T> {
    /// A decoder that skips special tokens when `skip_special` is set.
    pub fn new(tokenizer: T, skip_special: bool) -> Self {
        Self { tokenizer, skip_special, pending: Vec::new(), ids: Vec::new(), prefix_offset: 0, read_offset: 0 }
    }

    /// Feeds one id; returns the text that became complete (possibly empty). Unknown ids are errors and leave the
    /// state unchanged.
    pub fn step(&mut self, id: u32) -> Result<String> {
        if self.tokenizer.has_exact_token_bytes() {
            if self.skip_special && self.tokenizer.is_special(id) {
                self.tokenizer.check_id(id)?;
                return Ok(String::new());
            }
            let bytes = self.tokenizer.token_bytes(id)?;
            self.pending.extend_from_slice(&bytes);
            Ok(drain_valid_utf8(&mut self.pending))
        } else {
            self.step_redecode(id)
        }
    }

    /// Feeds several ids; returns the concatenated complete text.
    pub fn step_all(&mut self, ids: &[u32]) -> Result<String> {
        let mut out = String::new();
        for &id in ids {
            out.push_str(&self.step(id)?);
        }
        Ok(out)
    }

    /// Ends the stream: whatever is still buffered, with U+FFFD for an incomplete sequence.
    pub fn flush(&mut self) -> Result<String> {
        if self.tokenizer.has_exact_token_bytes() {
            let out = String::from_utf8_lossy(&self.pending).into_owned();
            self.pending.clear();
            return Ok(out);
        }
        let prefix = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = self.tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        Ok(full.get(prefix.len()..).unwrap_or_default().to_owned())
    }

    fn step_redecode(&mut self, id: u32) -> Result<String> {
        self.tokenizer.check_id(id)?;
        self.ids.push(id);
        let prefix = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = self.tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let new = full[prefix.len()..].to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            // Keep the window short: drop ids that no longer influence the prefix text.
            if self.prefix_offset > 64 {
                self.ids.drain(..self.prefix_offset);
                self.read_offset -= self.prefix_offset;
                self.prefix_offset = 0;
            }
            Ok(new)
        } else {
            Ok(String::new())
        }
    }
}

/// Removes and returns the longest prefix of `buf` that is settled: valid UTF-8, with every invalid sequence
/// replaced by U+FFFD; an incomplete sequence at the end stays in `buf`.
fn drain_valid_utf8(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
                break;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // The prefix up to `valid` was just checked, so this never falls back.
                out.push_str(std::str::from_utf8(&buf[start..start + valid]).unwrap_or_default());
                match e.error_len() {
                    Some(len) => {
                        out.push('\u{FFFD}');
                        start += valid + len;
                    }
                    None => {
                        start += valid;
                        break;
                    }
                }
            }
        }
    }
    buf.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(chunks: &[&[u8]]) -> (String, Vec<u8>) {
        let mut buf = Vec::new();
        let mut out = String::new();
        for c in chunks {
            buf.extend_from_slice(c);
            out.push_str(&drain_valid_utf8(&mut buf));
        }
        (out, buf)
    }

    #[test]
    fn buffers_split_multibyte_chars() {
        let euro = "€".as_bytes(); // e2 82 ac
        let (out, rest) = feed(&[b"a", &euro[..1]]);
        assert_eq!((out.as_str(), rest.as_slice()), ("a", &euro[..1]));
        let (out, rest) = feed(&[b"a", &euro[..1], &euro[1..2], &euro[2..]]);
        assert_eq!(out, "a€");
        assert!(rest.is_empty());
        let crab = "🦀".as_bytes();
        let (out, _) = feed(&[&crab[..2], &crab[2..3], &crab[3..], b"!"]);
        assert_eq!(out, "🦀!");
    }

    #[test]
    fn invalid_bytes_match_from_utf8_lossy() {
        let cases: &[&[&[u8]]] = &[
            &[b"\xff", b"a"],
            &[b"\xe2\x82", b"a"],
            &[b"\xe2", b"\x82", b"\xe2\x82\xac"],
            &[b"\xf0\x9f", b"\xa6", b"x\x80"],
            &[b"\xc0\xaf", b"ok"],
        ];
        for chunks in cases {
            let all: Vec<u8> = chunks.concat();
            let (mut out, rest) = feed(chunks);
            out.push_str(&String::from_utf8_lossy(&rest));
            assert_eq!(out, String::from_utf8_lossy(&all), "{chunks:?}");
        }
    }
}
