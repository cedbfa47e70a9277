//! Kimi's tiktoken tokenizer: `tiktoken.model` ranks (`base64(bytes) rank` per line) plus the special tokens of
//! `tokenizer_config.json`, encoded exactly as Python tiktoken does with Moonshot's pre-tokenizer pattern.
//!
//! Encoding: split the text at special tokens (only when they are allowed), cut each stretch with [`KIMI_PATTERN`]
//! (fancy-regex, the engine tiktoken itself uses), map a piece that is a whole token directly, else byte-pair merge
//! it. Special ids follow the ranks: `n_base..n_base + 256`, names from `added_tokens_decoder`, the rest
//! `<|reserved_token_{id}|>` (as Moonshot's `tokenization_kimi.py` does).

use std::collections::HashMap;
use std::path::Path;

use base64::Engine as _;
use fancy_regex::Regex;

use super::bpe::{Ranks, byte_pair_encode};
use super::config::TokenizerConfig;
use super::error::{Result, TokenizerError};

/// Moonshot's pre-tokenizer pattern (`tokenization_kimi.py`), the `|`-join of these alternatives in order. The
/// class intersections (`&&[^\p{Han}]`) are handed by fancy-regex to the `regex` crate, which supports them; the
/// golden tests check the split against Python tiktoken on Han, kana, Latin, digits and whitespace.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// Number of special-token slots after the base ranks (Kimi: 163584..163840).
pub const NUM_RESERVED_SPECIAL: u32 = 256;

/// Special ids may lie at most this far past the base ranks (a bound against absurd configs).
const MAX_SPECIAL_OFFSET: u32 = 1 << 16;

/// A loaded tiktoken BPE with its special tokens.
#[derive(Debug)]
pub struct TiktokenBpe {
    ranks: Ranks,
    /// Token bytes by id for the base ranks (`None` for a hole in the ranks).
    decoder: Vec<Option<Vec<u8>>>,
    /// Special token text -> id.
    special: HashMap<String, u32>,
    /// Special id -> text.
    special_by_id: HashMap<u32, String>,
    pattern: Regex,
    /// Alternation of the special tokens, longest first (so leftmost-first is leftmost-longest).
    special_pattern: Option<Regex>,
    vocab_size: usize,
}

impl TiktokenBpe {
    /// Loads `ranks_path` (a `tiktoken.model`) and the special tokens of `config`.
    pub fn load(ranks_path: &Path, config: &TokenizerConfig) -> Result<Self> {
        let text = std::fs::read(ranks_path).map_err(|e| TokenizerError::io(ranks_path, e))?;
        let ranks = parse_ranks(ranks_path, &text)?;
        Self::new(ranks_path, ranks, config)
    }

    /// Builds from parsed ranks; `origin` only labels errors.
    pub(crate) fn new(origin: &Path, ranks: Ranks, config: &TokenizerConfig) -> Result<Self> {
        let n_base = ranks.values().map(|&r| r + 1).max().unwrap_or(0);
        if n_base as usize != ranks.len() {
            let message =
                format!("ranks are not contiguous: {} entries but the largest rank is {}", ranks.len(), n_base - 1);
            return Err(TokenizerError::bad_config(origin, "<ranks>", message));
        }
        let mut decoder = vec![None; n_base as usize];
        for (bytes, &rank) in &ranks {
            decoder[rank as usize] = Some(bytes.clone());
        }
        let mut special_by_id: HashMap<u32, String> = HashMap::new();
        for (&id, spec) in &config.added_tokens {
            if id < n_base || id - n_base >= MAX_SPECIAL_OFFSET {
                let field = format!("added_tokens_decoder.{id}");
                return Err(TokenizerError::bad_config(
                    &config.path,
                    field,
                    format!("special ids must lie in {n_base}..{}", n_base + MAX_SPECIAL_OFFSET),
                ));
            }
            special_by_id.insert(id, spec.content.clone());
        }
        let top = special_by_id.keys().map(|&id| id + 1).max().unwrap_or(0).max(n_base + NUM_RESERVED_SPECIAL);
        for id in n_base..top {
            special_by_id.entry(id).or_insert_with(|| format!("<|reserved_token_{id}|>"));
        }
        let mut special = HashMap::new();
        for (&id, text) in &special_by_id {
            if let Some(other) = special.insert(text.clone(), id) {
                let field = format!("added_tokens_decoder.{}", id.max(other));
                return Err(TokenizerError::bad_config(&config.path, field, format!("duplicate token {text:?}")));
            }
        }
        if ranks.len() < 256 || (0..=255u8).any(|b| !ranks.contains_key(&[b][..])) {
            return Err(TokenizerError::bad_config(origin, "<ranks>", "not every single byte has a rank"));
        }
        let pattern = Regex::new(KIMI_PATTERN).map_err(|e| TokenizerError::Regex { message: e.to_string() })?;
        let special_pattern = special_regex(special.keys())?;
        Ok(Self { ranks, decoder, special, special_by_id, pattern, special_pattern, vocab_size: top as usize })
    }

    /// `max id + 1`: base ranks plus special slots.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Number of base (byte-level) ranks; special ids start here.
    pub fn num_base_tokens(&self) -> u32 {
        self.decoder.len() as u32
    }

    /// Encodes `text`; with `allow_special`, special-token strings become their ids.
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut start = 0;
        if allow_special && let Some(special_re) = &self.special_pattern {
            for m in special_re.find_iter(text) {
                let m = m.map_err(|e| TokenizerError::Regex { message: e.to_string() })?;
                self.encode_ordinary_into(&text[start..m.start()], &mut out)?;
                let id = self.special.get(m.as_str()).copied();
                out.push(
                    id.ok_or_else(|| TokenizerError::Regex { message: "special match outside the table".into() })?,
                );
                start = m.end();
            }
        }
        self.encode_ordinary_into(&text[start..], &mut out)?;
        Ok(out)
    }

    fn encode_ordinary_into(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        for m in self.pattern.find_iter(text) {
            let m = m.map_err(|e| TokenizerError::Regex { message: e.to_string() })?;
            let piece = m.as_str().as_bytes();
            if let Some(&id) = self.ranks.get(piece) {
                out.push(id);
                continue;
            }
            // Every byte has a rank (checked at load), so the merge always succeeds.
            let ids = byte_pair_encode(&self.ranks, piece)
                .ok_or_else(|| TokenizerError::Regex { message: "piece with an unranked byte".into() })?;
            out.extend(ids);
        }
        Ok(())
    }

    /// The bytes of `id`: raw bytes for a base rank, the UTF-8 text for a special token.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        if let Some(Some(bytes)) = self.decoder.get(id as usize) {
            return Ok(bytes);
        }
        self.special_by_id
            .get(&id)
            .map(|s| s.as_bytes())
            .ok_or(TokenizerError::UnknownId { id, vocab_size: self.vocab_size })
    }

    /// Whether `id` is one of the special slots.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_by_id.contains_key(&id)
    }

    /// Concatenated bytes of `ids` (special tokens skipped when asked).
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(out)
    }

    /// Special token text -> id.
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.special.get(text).copied()
    }

    /// A token's id: a special token by name, else a base token by its UTF-8 bytes.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.special_id(token).or_else(|| self.ranks.get(token.as_bytes()).copied())
    }
}

/// Parses a ranks file: one `base64(bytes) rank` per non-empty line.
pub(crate) fn parse_ranks(path: &Path, text: &[u8]) -> Result<Ranks> {
    let text = std::str::from_utf8(text).map_err(|e| TokenizerError::BadRanksLine {
        path: path.into(),
        line: text[..e.valid_up_to()].iter().filter(|&&b| b == b'\n').count() + 1,
        message: "not UTF-8".into(),
    })?;
    let mut ranks = Ranks::with_capacity(text.len() / 12);
    let mut seen_rank: HashMap<u32, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let bad = |message: String| TokenizerError::BadRanksLine { path: path.into(), line: line_no, message };
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(token), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(bad(format!("expected `base64 rank`, got {line:?}")));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|e| bad(format!("bad base64 {token:?}: {e}")))?;
        let rank: u32 = rank.parse().map_err(|_| bad(format!("bad rank {rank:?}")))?;
        if let Some(first) = seen_rank.insert(rank, line_no) {
            return Err(bad(format!("rank {rank} already given on line {first}")));
        }
        if ranks.insert(bytes, rank).is_some() {
            return Err(bad(format!("token {token:?} listed twice")));
        }
    }
    Ok(ranks)
}

/// A regex matching any special token, longest alternatives first.
fn special_regex<'a>(names: impl Iterator<Item = &'a String>) -> Result<Option<Regex>> {
    let mut names: Vec<&String> = names.collect();
    if names.is_empty() {
        return Ok(None);
    }
    names.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
    let alternation = names.iter().map(|n| fancy_regex::escape(n)).collect::<Vec<_>>().join("|");
    Regex::new(&alternation).map(Some).map_err(|e| TokenizerError::Regex { message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::config::AddedTokenSpec;

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    fn byte_ranks_text(extra: &[&[u8]]) -> String {
        let mut s = String::new();
        for b in 0..=255u8 {
            s.push_str(&format!("{} {}\n", b64(&[b]), b));
        }
        for (i, t) in extra.iter().enumerate() {
            s.push_str(&format!("{} {}\n", b64(t), 256 + i));
        }
        s
    }

    fn small() -> TiktokenBpe {
        let ranks =
            parse_ranks(Path::new("t.model"), byte_ranks_text(&[b"he", b"ll", b"hell", b"hello"]).as_bytes()).unwrap();
        let mut cfg = TokenizerConfig::default();
        cfg.added_tokens.insert(262, AddedTokenSpec { content: "<|im_end|>".into(), special: true });
        TiktokenBpe::new(Path::new("t.model"), ranks, &cfg).unwrap()
    }

    #[test]
    fn encodes_whole_tokens_merges_and_specials() {
        let t = small();
        assert_eq!(t.num_base_tokens(), 260);
        assert_eq!(t.vocab_size(), 260 + 256);
        assert_eq!(t.encode("hello", false).unwrap(), vec![259]);
        assert_eq!(t.encode("hell", false).unwrap(), vec![258]);
        assert_eq!(t.encode("hi<|im_end|>", true).unwrap(), vec![b'h' as u32, b'i' as u32, 262]);
        // Without allow_special the marker is plain text.
        let plain = t.encode("<|im_end|>", false).unwrap();
        assert!(!plain.contains(&262));
        assert_eq!(t.decode_bytes(&plain, false).unwrap(), b"<|im_end|>");
        assert_eq!(t.special_id("<|reserved_token_300|>"), Some(300));
        assert_eq!(t.token_to_id("hello"), Some(259));
    }

    #[test]
    fn decode_skips_specials_and_rejects_unknown_ids() {
        let t = small();
        assert_eq!(t.decode_bytes(&[259, 262], false).unwrap(), b"hello<|im_end|>");
        assert_eq!(t.decode_bytes(&[259, 262], true).unwrap(), b"hello");
        let err = t.decode_bytes(&[259, 99999], false).unwrap_err();
        assert!(matches!(err, TokenizerError::UnknownId { id: 99999, .. }));
        assert!(err.to_string().contains("99999"));
    }

    #[test]
    fn bad_base64_names_the_line() {
        let mut text = byte_ranks_text(&[]);
        text.push_str("!!notbase64!! 256\n");
        let err = parse_ranks(Path::new("x/tiktoken.model"), text.as_bytes()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, TokenizerError::BadRanksLine { line: 257, .. }), "{msg}");
        assert!(msg.contains("x/tiktoken.model:257"), "{msg}");
    }

    #[test]
    fn bad_rank_and_duplicates_name_the_line() {
        let err = parse_ranks(Path::new("m"), b"YQ== 0\nYg== x\n").unwrap_err();
        assert!(matches!(err, TokenizerError::BadRanksLine { line: 2, .. }), "{err}");
        let err = parse_ranks(Path::new("m"), b"YQ== 0\nYg== 0\n").unwrap_err();
        assert!(err.to_string().contains("already given on line 1"), "{err}");
        let err = parse_ranks(Path::new("m"), b"YQ==\n").unwrap_err();
        assert!(matches!(err, TokenizerError::BadRanksLine { line: 1, .. }), "{err}");
    }

    #[test]
    fn sparse_ranks_and_far_special_ids_are_rejected() {
        let mut text = byte_ranks_text(&[]);
        text.push_str("YWJj 4000000000\n");
        let ranks = parse_ranks(Path::new("m"), text.as_bytes()).unwrap();
        let err = TiktokenBpe::new(Path::new("m"), ranks, &TokenizerConfig::default()).unwrap_err();
        assert!(err.to_string().contains("not contiguous"), "{err}");
        let ranks = parse_ranks(Path::new("m"), byte_ranks_text(&[]).as_bytes()).unwrap();
        let mut cfg = TokenizerConfig { path: "cfg.json".into(), ..TokenizerConfig::default() };
        cfg.added_tokens.insert(10, AddedTokenSpec { content: "<x>".into(), special: true });
        let err = TiktokenBpe::new(Path::new("m"), ranks.clone(), &cfg).unwrap_err();
        assert!(err.to_string().contains("cfg.json: added_tokens_decoder.10"), "{err}");
        cfg.added_tokens.clear();
        cfg.added_tokens.insert(u32::MAX, AddedTokenSpec { content: "<x>".into(), special: true });
        assert!(TiktokenBpe::new(Path::new("m"), ranks, &cfg).is_err());
    }

    #[test]
    fn missing_byte_rank_is_rejected() {
        let ranks = parse_ranks(Path::new("m"), b"YQ== 0\n").unwrap();
        let err = TiktokenBpe::new(Path::new("m"), ranks, &TokenizerConfig::default()).unwrap_err();
        assert!(err.to_string().contains("single byte"), "{err}");
    }

    #[test]
    fn pattern_splits_like_kimi() {
        let re = Regex::new(KIMI_PATTERN).unwrap();
        let pieces = |s: &str| re.find_iter(s).map(|m| m.unwrap().as_str().to_owned()).collect::<Vec<_>>();
        assert_eq!(pieces("Hello world's 12345"), ["Hello", " world's", " ", "123", "45"]);
        assert_eq!(pieces("中文abc"), ["中文", "abc"]);
        assert_eq!(pieces("CamelCase  x\r\n"), ["Camel", "Case", " ", " x", "\r\n"]);
    }
}
