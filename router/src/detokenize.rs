//! Incremental detokenization: generated token ids in, text deltas out.
//!
//! Decoding one token alone is wrong in two ways: a byte-fallback token may
//! hold half of a UTF-8 character, and SentencePiece-style decoders strip or
//! merge spaces depending on the neighbours. So each step decodes a small
//! window twice and emits the difference:
//!
//! ```text
//!   tokens:  t0 t1 t2 t3 t4 t5
//!                  ^        ^    ^
//!       prefix_offset  read_offset  len
//!   prefix_text = decode(tokens[prefix_offset..read_offset])
//!   new_text    = decode(tokens[prefix_offset..len])
//!   delta       = new_text[prefix_text.len()..]   (held back while it ends
//!                 in U+FFFD: the next token may complete the character)
//! ```
//!
//! Tokens that add no text (special tokens, which decoding skips, or a run of
//! bytes that never forms a character) would grow the window, and each push
//! would decode all of it again: quadratic in a long output. So the window
//! releases what it holds after `MAX_HELD_TOKENS` tokens without new text,
//! replacement characters included, as the full decode shows them.
//!
//! `finish` returns what the window never released (a truncated character
//! at the very end), so the concatenation of all deltas equals the decode of
//! all tokens.

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Tokens that may add no text before the window is released anyway: more
/// than a UTF-8 character's 4 bytes, with room for tokens a decoder merges.
const MAX_HELD_TOKENS: usize = 8;

pub struct Detokenizer {
    tokenizer: Tokenizer,
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Byte length of everything returned so far.
    emitted_len: usize,
}

impl Detokenizer {
    pub fn new(tokenizer: Tokenizer) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            emitted_len: 0,
        }
    }

    /// Adds one token; returns the text it completes (often empty while a
    /// multi-byte character is still being assembled).
    pub fn push(&mut self, token_id: u32) -> Result<String, TokenizerError> {
        self.tokens.push(token_id);
        let prefix_text = self
            .tokenizer
            .decode(&self.tokens[self.prefix_offset..self.read_offset], true)?;
        let new_text = self.tokenizer.decode(&self.tokens[self.prefix_offset..], true)?;
        let held_too_long = self.tokens.len() - self.read_offset >= MAX_HELD_TOKENS;
        let grew = new_text.len() > prefix_text.len();
        if !held_too_long && (!grew || new_text.ends_with('\u{FFFD}')) {
            return Ok(String::new());
        }
        // `None`: the window's decode changed inside a character; wait for
        // more, unless the window has waited too long (`finish` then returns
        // whatever the full decode holds past what was emitted).
        let delta = if grew { new_text.get(prefix_text.len()..) } else { Some("") };
        if delta.is_none() && !held_too_long {
            return Ok(String::new());
        }
        let delta = delta.unwrap_or_default();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        self.emitted_len += delta.len();
        Ok(delta.to_string())
    }

    /// The rest of the full decode after what `push` returned.
    pub fn finish(&mut self) -> Result<String, TokenizerError> {
        let full = self.tokenizer.decode(&self.tokens, true)?;
        let rest = full.get(self.emitted_len..).unwrap_or_default().to_string();
        self.emitted_len = full.len();
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(rest)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A byte-fallback BPE tokenizer as Llama 2 / Mistral ship it: ids 3..259
    /// are the bytes <0x00>..<0xFF>, the decoder turns '▁' into a space,
    /// fuses bytes into UTF-8 and strips one leading space.
    pub(crate) fn byte_fallback_tokenizer() -> Tokenizer {
        Tokenizer::new(byte_fallback_inner())
    }

    /// The tokenizers library's tokenizer behind `byte_fallback_tokenizer`
    /// (for tests that add tokens to it).
    pub(crate) fn byte_fallback_inner() -> tokenizers::Tokenizer {
        let mut vocab = serde_json::Map::new();
        for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert(t.to_string(), i.into());
        }
        for b in 0..=255u32 {
            vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
        }
        for (i, t) in ["▁", "a", "▁b", "é", "▁Hello", "▁world", "!", "lo"].iter().enumerate() {
            vocab.insert(t.to_string(), (259 + i).into());
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [
                {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
            ]},
            "pre_tokenizer": null,
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": []}
        });
        json.to_string().parse().unwrap()
    }

    fn byte(b: u8) -> u32 {
        3 + b as u32
    }

    fn run(tokenizer: &Tokenizer, ids: &[u32]) -> (Vec<String>, String) {
        let mut detok = Detokenizer::new(tokenizer.clone());
        let mut deltas: Vec<String> = ids.iter().map(|&id| detok.push(id).unwrap()).collect();
        deltas.push(detok.finish().unwrap());
        (deltas, tokenizer.decode(ids, true).unwrap())
    }

    #[test]
    fn byte_fallback_characters_are_never_split() {
        let t = byte_fallback_tokenizer();
        // "a" "😀"(F0 9F 98 80) "▁b" "é"(C3 A9 as bytes) "é"(token) "!"
        let ids = [260, byte(0xF0), byte(0x9F), byte(0x98), byte(0x80), 261, byte(0xC3), byte(0xA9), 262, 265];
        let (deltas, full) = run(&t, &ids);
        assert_eq!(full, "a😀 béé!");
        assert_eq!(deltas.concat(), full);
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
        // The emoji appears whole, with its last byte.
        assert_eq!(deltas[4], "😀");
        assert_eq!(deltas[1..4], ["", "", ""]);
    }

    #[test]
    fn spaces_survive_sentencepiece_stripping() {
        let t = byte_fallback_tokenizer();
        let ids = [263, 264, 265, 2]; // ▁Hello ▁world ! </s>
        let (deltas, full) = run(&t, &ids);
        assert_eq!(full, "Hello world!");
        assert_eq!(deltas, ["Hello", " world", "!", "", ""]);
    }

    #[test]
    fn truncated_character_at_the_end_matches_full_decode() {
        let t = byte_fallback_tokenizer();
        let ids = [260, byte(0xE4), byte(0xBD)]; // "a" + 2 of 3 bytes of "你"
        let (deltas, full) = run(&t, &ids);
        assert_eq!(deltas.concat(), full);
        assert!(full.ends_with('\u{FFFD}'));
        assert_eq!(deltas[0], "a");
    }

    #[test]
    fn random_sequences_concatenate_to_the_full_decode() {
        use rand::{Rng, SeedableRng};
        let t = byte_fallback_tokenizer();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let chars = ["é", "😀", "你", "a", " ", "ß"];
        for _ in 0..200 {
            // Random text spelled as byte tokens and word tokens.
            let mut ids = Vec::new();
            for _ in 0..rng.gen_range(1..12) {
                if rng.gen_bool(0.3) {
                    ids.push(rng.gen_range(259..267));
                } else {
                    let c = chars[rng.gen_range(0..chars.len())];
                    ids.extend(c.bytes().map(byte));
                }
            }
            let (deltas, full) = run(&t, &ids);
            assert_eq!(deltas.concat(), full, "{ids:?}");
            assert!(deltas[..ids.len()].iter().all(|d| !d.contains('\u{FFFD}')));
        }
    }

    #[test]
    fn tokens_without_text_keep_the_window_short() {
        let t = byte_fallback_tokenizer();
        let mut detok = Detokenizer::new(t.clone());
        // Special tokens decode to nothing; lone continuation bytes to U+FFFD.
        let mut ids: Vec<u32> = std::iter::repeat_n(1, 1000).collect();
        ids.extend(std::iter::repeat_n(byte(0x80), 1000));
        ids.extend([263, 265]); // ▁Hello !
        let mut deltas = Vec::new();
        for &id in &ids {
            deltas.push(detok.push(id).unwrap());
            assert!(detok.tokens.len() - detok.prefix_offset <= 2 * MAX_HELD_TOKENS, "the window grew to {}", detok.tokens.len() - detok.prefix_offset);
        }
        deltas.push(detok.finish().unwrap());
        let full = t.decode(&ids, true).unwrap();
        assert_eq!(deltas.concat(), full);
        assert!(deltas.last().unwrap().is_empty(), "everything was released before the end");
        assert!(full.ends_with("Hello!"), "{full}");
    }
}
