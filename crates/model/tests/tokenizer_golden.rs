//! Golden tests: Eyrie's tokenizers against Python tiktoken 0.14 / tokenizers 0.23 on the committed fixtures.
//!
//! Regenerate the fixtures with `python3 scripts/fixtures_tokenizer.py`. Every case must match exactly: ids with
//! special tokens allowed and as plain text, decoded text (with and without special tokens), streaming output.

use std::path::PathBuf;

use eyrie_model::tokenizer::{Tokenizer, TokenizerError, TokenizerKind};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tokenizer")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).expect("fixtures/tokenizer/expected.json");
    serde_json::from_str(&text).expect("expected.json parses")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn stream_all(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> String {
    let mut dec = tok.stream_decoder(skip_special);
    let mut out = String::new();
    for &id in ids {
        let piece = dec.step(id).expect("known id");
        assert!(!piece.contains('\u{FFFD}') || tok.decode(ids, skip_special).unwrap().contains('\u{FFFD}'));
        out.push_str(&piece);
    }
    out.push_str(&dec.flush().unwrap());
    out
}

fn check_cases(tok: &Tokenizer, section: &Value) {
    let cases = section["cases"].as_array().unwrap();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text, true).unwrap(), want, "encode(allow_special) of {text:?}");
        assert_eq!(tok.encode(text, false).unwrap(), ids(&case["ids_plain"]), "encode(plain) of {text:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), case["decoded"].as_str().unwrap(), "decode of {text:?}");
        let skip = case["decoded_skip_special"].as_str().unwrap();
        assert_eq!(tok.decode(&want, true).unwrap(), skip, "decode(skip_special) of {text:?}");
        assert_eq!(stream_all(tok, &want, false), case["decoded"].as_str().unwrap(), "stream of {text:?}");
        assert_eq!(stream_all(tok, &want, true), skip, "stream(skip_special) of {text:?}");
    }
    for case in section["decode"].as_array().unwrap() {
        let want = case["text"].as_str().unwrap();
        let ids = ids(&case["ids"]);
        assert_eq!(tok.decode(&ids, false).unwrap(), want, "decode of {ids:?}");
        assert_eq!(stream_all(tok, &ids, false), want, "stream of {ids:?}");
    }
}

#[test]
fn kimi_tiktoken_matches_python_tiktoken() {
    let exp = expected();
    let tok = Tokenizer::from_dir(fixtures().join("kimi")).unwrap();
    assert_eq!(tok.kind(), TokenizerKind::Tiktoken);
    let n_base = exp["kimi"]["n_base"].as_u64().unwrap() as u32;
    assert_eq!(tok.vocab_size() as u64, exp["kimi"]["vocab_size"].as_u64().unwrap());
    check_cases(&tok, &exp["kimi"]);

    // Special tokens sit right after the base ranks, at Kimi's offsets.
    assert_eq!(tok.bos_token_id(), Some(n_base));
    assert_eq!(tok.eos_token_ids(), &[n_base + 1, n_base + 2]);
    for (name, offset) in
        [("<|im_end|>", 2), ("<|im_user|>", 3), ("<|im_middle|>", 17), ("<think>", 22), ("</think>", 23)]
    {
        assert_eq!(tok.special_token_id(name), Some(n_base + offset), "{name}");
        assert_eq!(tok.token_to_id(name), Some(n_base + offset), "{name}");
        assert_eq!(tok.id_to_token(n_base + offset).as_deref(), Some(name));
        assert!(tok.is_special(n_base + offset));
    }
    let reserved = format!("<|reserved_token_{}|>", n_base + 5);
    assert_eq!(tok.special_token_id(&reserved), Some(n_base + 5));
    assert_eq!(tok.special_token_id("hello"), None);
    assert_eq!(&*tok.token_bytes(u32::from(b'a')).unwrap(), b"a");
}

#[test]
fn hf_byte_level_matches_python_tokenizers() {
    let exp = expected();
    let tok = Tokenizer::from_dir(fixtures().join("hf")).unwrap();
    assert_eq!(tok.kind(), TokenizerKind::HuggingFace);
    assert_eq!(tok.vocab_size() as u64, exp["hf"]["vocab_size"].as_u64().unwrap());
    check_cases(&tok, &exp["hf"]);
    let im_end = tok.special_token_id("<|im_end|>").unwrap();
    assert_eq!(tok.eos_token_ids(), &[im_end]);
    assert_eq!(tok.bos_token_id(), None);
    // `<tool_call>` is an added token but not a special one.
    let tool_call = tok.token_to_id("<tool_call>").unwrap();
    assert!(!tok.is_special(tool_call));
    assert_eq!(tok.special_token_id("<tool_call>"), None);
    assert_eq!(&*tok.token_bytes(im_end).unwrap(), b"<|im_end|>");
}

/// A tiny deterministic generator, so the test needs no `rand` dependency.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn streaming_equals_decode_on_random_ids() {
    for dir in ["kimi", "hf"] {
        let tok = Tokenizer::from_dir(fixtures().join(dir)).unwrap();
        let mut rng = Lcg(42);
        let n = tok.vocab_size() as u64;
        for round in 0..300 {
            let len = 1 + rng.below(24) as usize;
            // Bias towards the byte tokens so that broken UTF-8 is common.
            let ids: Vec<u32> =
                (0..len).map(|_| if rng.below(2) == 0 { rng.below(256) as u32 } else { rng.below(n) as u32 }).collect();
            let ids: Vec<u32> = ids.into_iter().filter(|&id| tok.id_to_token(id).is_some()).collect();
            for skip in [false, true] {
                let want = tok.decode(&ids, skip).unwrap();
                assert_eq!(stream_all(&tok, &ids, skip), want, "{dir} round {round} ids {ids:?}");
            }
        }
    }
}

#[test]
fn unknown_ids_are_errors_naming_the_id() {
    for dir in ["kimi", "hf"] {
        let tok = Tokenizer::from_dir(fixtures().join(dir)).unwrap();
        let bad = tok.vocab_size() as u32 + 7;
        let err = tok.decode(&[1, bad], false).unwrap_err();
        assert!(matches!(err, TokenizerError::UnknownId { id, .. } if id == bad), "{dir}: {err}");
        assert!(err.to_string().contains(&bad.to_string()));
        assert!(tok.token_bytes(bad).is_err());
        let mut dec = tok.stream_decoder(false);
        assert!(dec.step(bad).is_err());
        let a = tok.encode("a", false).unwrap();
        assert_eq!(dec.step_all(&a).unwrap(), "a", "{dir}: state survives an unknown id");
    }
}

#[test]
fn emoji_split_across_byte_tokens_streams_whole() {
    let tok = Tokenizer::from_dir(fixtures().join("kimi")).unwrap();
    let crab = "🦀".as_bytes();
    let ids: Vec<u32> = crab.iter().map(|&b| u32::from(b)).collect();
    let mut dec = tok.stream_decoder(false);
    assert_eq!(dec.step(ids[0]).unwrap(), "");
    assert_eq!(dec.step(ids[1]).unwrap(), "");
    assert_eq!(dec.step(ids[2]).unwrap(), "");
    assert_eq!(dec.step(ids[3]).unwrap(), "🦀");
    // An interrupted sequence becomes one replacement char, then the stream goes on.
    assert_eq!(dec.step(ids[0]).unwrap(), "");
    assert_eq!(dec.step(u32::from(b'x')).unwrap(), "\u{FFFD}x");
    assert_eq!(dec.step(ids[0]).unwrap(), "");
    assert_eq!(dec.flush().unwrap(), "\u{FFFD}");
}
