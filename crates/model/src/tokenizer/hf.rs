//! Hugging Face `tokenizer.json` tokenizers through the `tokenizers` crate (fancy-regex backend, no hub access).
//!
//! Byte-level BPE tokenizers (GPT-2 style `ByteLevel` decoder) get exact per-token bytes through the GPT-2
//! byte-to-unicode table, so streaming decodes never split a UTF-8 sequence; other tokenizers stream through
//! incremental re-decoding (see [`super::stream`]).

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use super::error::{Result, TokenizerError};

/// A `tokenizer.json` tokenizer.
#[derive(Debug)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// A copy that treats special-token strings as plain text, made on first use.
    plain: OnceLock<tokenizers::Tokenizer>,
    byte_level: bool,
    /// Id -> added token content and its `special` flag.
    added: HashMap<u32, (String, bool)>,
    vocab_size: usize,
}

impl HfTokenizer {
    /// Loads `path` (a `tokenizer.json`).
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| TokenizerError::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|source| TokenizerError::Hf { context: path.display().to_string(), source })?;
        Ok(Self::from_tokenizer(inner))
    }

    /// Wraps an already-built tokenizer.
    pub fn from_tokenizer(inner: tokenizers::Tokenizer) -> Self {
        let byte_level = inner
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .is_some_and(|v| json_mentions_type(&v, "ByteLevel"));
        let added: HashMap<u32, (String, bool)> =
            inner.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, (t.content.clone(), t.special))).collect();
        let max_model = inner.get_vocab(false).values().copied().max().map_or(0, |m| m as usize + 1);
        let max_added = added.keys().copied().max().map_or(0, |m| m as usize + 1);
        Self { inner, plain: OnceLock::new(), byte_level, added, vocab_size: max_model.max(max_added) }
    }

    /// `max id + 1`.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether per-token bytes are exact (a `ByteLevel` decoder).
    pub fn is_byte_level(&self) -> bool {
        self.byte_level
    }

    /// Encodes without adding BOS/EOS; with `allow_special` special-token strings become their ids.
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>> {
        let tok = if allow_special {
            &self.inner
        } else {
            self.plain.get_or_init(|| {
                let mut t = self.inner.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        let enc = tok.encode(text, false).map_err(|source| TokenizerError::Hf { context: "encode".into(), source })?;
        Ok(enc.get_ids().to_vec())
    }

    fn check(&self, id: u32) -> Result<()> {
        if self.added.contains_key(&id) || self.inner.id_to_token(id).is_some() {
            Ok(())
        } else {
            Err(TokenizerError::UnknownId { id, vocab_size: self.vocab_size })
        }
    }

    /// Decodes `ids` with the tokenizer's own decoder.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        for &id in ids {
            self.check(id)?;
        }
        self.inner.decode(ids, skip_special).map_err(|source| TokenizerError::Hf { context: "decode".into(), source })
    }

    /// Whether `id` is an added token flagged special.
    pub fn is_special(&self, id: u32) -> bool {
        self.added.get(&id).is_some_and(|(_, special)| *special)
    }

    /// The token string of `id` (byte-level tokens in their GPT-2 unicode form).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The bytes `id` stands for. Exact for byte-level tokenizers (as the `ByteLevel` decoder maps them: every
    /// char through the byte table, or the raw UTF-8 when a char is not in it); for others the token string with
    /// SentencePiece's `▁` as a space and `<0xNN>` byte-fallback tokens as their byte.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        let token = self.inner.id_to_token(id).ok_or(TokenizerError::UnknownId { id, vocab_size: self.vocab_size })?;
        if self.byte_level {
            let table = unicode_to_byte();
            let mapped: Option<Vec<u8>> = token.chars().map(|c| table.get(&c).copied()).collect();
            return Ok(mapped.unwrap_or_else(|| token.into_bytes()));
        }
        if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
            && hex.len() == 2
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            return Ok(vec![b]);
        }
        Ok(token.replace('\u{2581}', " ").into_bytes())
    }

    /// Added tokens: id -> (content, special).
    pub fn added_tokens(&self) -> &HashMap<u32, (String, bool)> {
        &self.added
    }
}

/// Whether a serialized decoder (possibly a `Sequence`) contains a component of `type`.
fn json_mentions_type(v: &serde_json::Value, ty: &str) -> bool {
    match v {
        serde_json::Value::Object(o) => {
            o.get("type").and_then(|t| t.as_str()) == Some(ty) || o.values().any(|x| json_mentions_type(x, ty))
        }
        serde_json::Value::Array(a) => a.iter().any(|x| json_mentions_type(x, ty)),
        _ => false,
    }
}

/// GPT-2's `bytes_to_unicode`, inverted: printable Latin-1 bytes map to themselves, the rest to U+0100 onward.
fn unicode_to_byte() -> &'static HashMap<char, u8> {
    static TABLE: OnceLock<HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let mut next = 256u32;
        let mut map = HashMap::with_capacity(256);
        for b in 0..=255u8 {
            let c = if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next).unwrap_or('\u{FFFD}');
                next += 1;
                c
            };
            map.insert(c, b);
        }
        map
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2() {
        let t = unicode_to_byte();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'\u{0120}'], b' '); // "Ġ"
        assert_eq!(t[&'\u{010A}'], b'\n'); // "Ċ"
        assert_eq!(t[&'a'], b'a');
        assert_eq!(t[&'\u{0100}'], 0);
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = HfTokenizer::load(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/tokenizer.json"), "{err}");
    }

    #[test]
    fn finds_byte_level_inside_a_sequence() {
        let v = serde_json::json!({"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteLevel"}]});
        assert!(json_mentions_type(&v, "ByteLevel"));
        assert!(!json_mentions_type(&serde_json::json!({"type": "Metaspace"}), "ByteLevel"));
    }
}
