//! Tokenizers: Kimi's tiktoken BPE and Hugging Face `tokenizer.json`, behind one [`Tokenizer`] type.
//!
//! [`Tokenizer::from_dir`] picks the implementation from the files present: `tiktoken.model` (Kimi-K2 / K2.5,
//! special tokens from `tokenizer_config.json`) or `tokenizer.json` (the `tokenizers` crate). Both encode without
//! adding BOS/EOS (chat templates write those), decode lossily only where bytes are not UTF-8, and stream through
//! [`StreamDecoder`]. Golden tests against Python tiktoken / tokenizers live in `tests/tokenizer_golden.rs`.

mod bpe;
pub mod config;
pub mod error;
pub mod hf;
pub mod stream;
pub mod tiktoken;

use std::borrow::Cow;
use std::path::Path;

pub use config::{AddedTokenSpec, TokenizerConfig};
pub use error::{Result, TokenizerError};
pub use hf::HfTokenizer;
pub use stream::StreamDecoder;
pub use tiktoken::{KIMI_PATTERN, TiktokenBpe};

/// Which implementation a [`Tokenizer`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// `tiktoken.model` ranks with Kimi's pre-tokenizer.
    Tiktoken,
    /// A Hugging Face `tokenizer.json`.
    HuggingFace,
}

#[derive(Debug)]
enum Backend {
    Tiktoken(Box<TiktokenBpe>),
    Hf(Box<HfTokenizer>),
}

/// A loaded tokenizer with its special tokens.
#[derive(Debug)]
pub struct Tokenizer {
    backend: Backend,
    config: TokenizerConfig,
    bos: Option<u32>,
    eos: Vec<u32>,
}

/// End-of-turn markers that also stop generation when they are special tokens of the vocabulary.
const END_OF_TURN: &[&str] = &["<|im_end|>"];

impl Tokenizer {
    /// Loads a tokenizer directory: `tiktoken.model` (preferred) or `tokenizer.json`, plus `tokenizer_config.json`
    /// when present (required for a tiktoken directory's special tokens to have their real names).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = TokenizerConfig::load_optional(dir)?;
        let ranks = dir.join("tiktoken.model");
        if ranks.is_file() {
            return Self::from_tiktoken_file(&ranks, config);
        }
        let json = dir.join("tokenizer.json");
        if json.is_file() {
            return Self::from_hf_file(&json, config);
        }
        Err(TokenizerError::NoTokenizer { dir: dir.to_path_buf() })
    }

    /// A tiktoken ranks file with the given config.
    pub fn from_tiktoken_file(ranks: &Path, config: TokenizerConfig) -> Result<Self> {
        let bpe = TiktokenBpe::load(ranks, &config)?;
        Self::assemble(Backend::Tiktoken(Box::new(bpe)), config)
    }

    /// A `tokenizer.json` with the given config.
    pub fn from_hf_file(path: &Path, config: TokenizerConfig) -> Result<Self> {
        let hf = HfTokenizer::load(path)?;
        Self::assemble(Backend::Hf(Box::new(hf)), config)
    }

    /// An already-built `tokenizers` tokenizer (e.g. parsed from JSON in memory) with the given config.
    pub fn from_hf_tokenizer(tokenizer: tokenizers::Tokenizer, config: TokenizerConfig) -> Result<Self> {
        Self::assemble(Backend::Hf(Box::new(HfTokenizer::from_tokenizer(tokenizer))), config)
    }

    fn assemble(backend: Backend, config: TokenizerConfig) -> Result<Self> {
        let mut tok = Self { backend, config, bos: None, eos: Vec::new() };
        let lookup = |tok: &Self, field: &str, name: &Option<String>| -> Result<Option<u32>> {
            match name {
                None => Ok(None),
                Some(name) => tok.token_to_id(name).map(Some).ok_or_else(|| {
                    TokenizerError::bad_config(
                        &tok.config.path,
                        field,
                        format!("token {name:?} is not in the vocabulary"),
                    )
                }),
            }
        };
        tok.bos = lookup(&tok, "bos_token", &tok.config.bos_token)?;
        let mut eos: Vec<u32> = lookup(&tok, "eos_token", &tok.config.eos_token)?.into_iter().collect();
        for name in END_OF_TURN {
            if let Some(id) = tok.special_token_id(name)
                && !eos.contains(&id)
            {
                eos.push(id);
            }
        }
        tok.eos = eos;
        Ok(tok)
    }

    /// Which implementation this is.
    pub fn kind(&self) -> TokenizerKind {
        match self.backend {
            Backend::Tiktoken(_) => TokenizerKind::Tiktoken,
            Backend::Hf(_) => TokenizerKind::HuggingFace,
        }
    }

    /// The `tokenizer_config.json` it was loaded with (chat template, bos/eos names).
    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    /// Encodes `text` without adding BOS/EOS. With `allow_special`, special-token strings in the text become their
    /// ids (tiktoken's `allowed_special="all"`); without, they are encoded as plain text.
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>> {
        match &self.backend {
            Backend::Tiktoken(t) => t.encode(text, allow_special),
            Backend::Hf(h) => h.encode(text, allow_special),
        }
    }

    /// Decodes `ids`; bytes that are not UTF-8 become U+FFFD. An id outside the vocabulary is an error naming it.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.backend {
            Backend::Tiktoken(t) => Ok(String::from_utf8_lossy(&t.decode_bytes(ids, skip_special)?).into_owned()),
            Backend::Hf(h) => h.decode(ids, skip_special),
        }
    }

    /// The bytes one token stands for (a special token: its text). See [`HfTokenizer::token_bytes`] for the
    /// meaning on non-byte-level HF tokenizers.
    pub fn token_bytes(&self, id: u32) -> Result<Cow<'_, [u8]>> {
        match &self.backend {
            Backend::Tiktoken(t) => t.token_bytes(id).map(Cow::Borrowed),
            Backend::Hf(h) => {
                if let Some((content, _)) = h.added_tokens().get(&id) {
                    return Ok(Cow::Owned(content.clone().into_bytes()));
                }
                h.token_bytes(id).map(Cow::Owned)
            }
        }
    }

    /// `max id + 1` (Kimi-K2: 163840).
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Tiktoken(t) => t.vocab_size(),
            Backend::Hf(h) => h.vocab_size(),
        }
    }

    /// The id of a token string: a special token by name, else a vocabulary entry (tiktoken: by its UTF-8 bytes;
    /// HF: by the token string as stored, e.g. `Ġthe`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::Tiktoken(t) => t.token_to_id(token),
            Backend::Hf(h) => h.token_to_id(token),
        }
    }

    /// The token string of `id` (tiktoken: its bytes as UTF-8, lossily; HF: as stored). `None` if unknown.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.backend {
            Backend::Tiktoken(t) => t.token_bytes(id).ok().map(|b| String::from_utf8_lossy(b).into_owned()),
            Backend::Hf(h) => h.id_to_token(id),
        }
    }

    /// The id of a special token by name (`<|im_end|>`, `<think>`, `[BOS]`, ...); `None` for ordinary tokens.
    pub fn special_token_id(&self, name: &str) -> Option<u32> {
        match &self.backend {
            Backend::Tiktoken(t) => t.special_id(name),
            Backend::Hf(h) => {
                h.added_tokens().iter().find(|(_, (c, special))| *special && c == name).map(|(&id, _)| id)
            }
        }
    }

    /// Whether `id` is a special token (skipped by `decode(.., skip_special = true)`).
    pub fn is_special(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Tiktoken(t) => t.is_special(id),
            Backend::Hf(h) => h.is_special(id),
        }
    }

    /// Ids that end generation: `eos_token` of the config, then `<|im_end|>` when it is a special token.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// `bos_token` of the config, if any (Kimi's chat format does not emit it).
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    /// A streaming decoder borrowing this tokenizer.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<&Self> {
        StreamDecoder::new(self, skip_special)
    }

    /// Whether [`Self::token_bytes`] is exact, so that streaming can work on bytes.
    pub(crate) fn has_exact_token_bytes(&self) -> bool {
        match &self.backend {
            Backend::Tiktoken(_) => true,
            Backend::Hf(h) => h.is_byte_level(),
        }
    }

    /// `Ok` if `id` is in the vocabulary, else [`TokenizerError::UnknownId`].
    pub(crate) fn check_id(&self, id: u32) -> Result<()> {
        self.token_bytes(id).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece-style tokenizer (Metaspace + byte fallback, Llama's decoder chain): not byte-level, so it
    /// streams by re-decoding, and must still give exactly `decode(all)`.
    fn sentencepiece_like() -> Tokenizer {
        let json = r#"{
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [
                {"id": 7, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false,
                 "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": true, "ignore_merges": false,
                "vocab": {"\u2581Hello": 0, "\u2581wor": 1, "ld": 2, "\u2581": 3, "<0xE2>": 4, "<0x82>": 5,
                          "<0xAC>": 6, "</s>": 7},
                "merges": []}
        }"#;
        let inner: tokenizers::Tokenizer = json.parse().unwrap();
        let config = TokenizerConfig { eos_token: Some("</s>".into()), ..TokenizerConfig::default() };
        Tokenizer::from_hf_tokenizer(inner, config).unwrap()
    }

    #[test]
    fn redecoding_stream_matches_decode_for_sentencepiece_style() {
        let tok = sentencepiece_like();
        assert!(!tok.has_exact_token_bytes());
        assert_eq!(tok.eos_token_ids(), &[7]);
        let ids = [0, 1, 2, 3, 4, 5, 6, 7];
        assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world €");
        let mut dec = tok.stream_decoder(true);
        let pieces: Vec<String> = ids.iter().map(|&id| dec.step(id).unwrap()).collect();
        assert_eq!(pieces, ["Hello", " wor", "ld", " ", "", "", "€", ""]);
        assert_eq!(dec.flush().unwrap(), "");
        // A stream cut inside the byte sequence ends with a replacement char, as decode does.
        let mut dec = tok.stream_decoder(false);
        let text = dec.step_all(&[0, 4, 5]).unwrap() + &dec.flush().unwrap();
        assert_eq!(text, tok.decode(&[0, 4, 5], false).unwrap());
        assert!(dec.step(99).is_err());
    }

    #[test]
    fn empty_dir_is_an_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("eyrie-tok-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(matches!(err, TokenizerError::NoTokenizer { .. }));
        assert!(err.to_string().contains(&dir.display().to_string()));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn missing_dir_config_is_not_needed_but_a_bad_one_is_reported() {
        let dir = std::env::temp_dir().join(format!("eyrie-tok-badcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), "{not json").unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer_config.json"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
