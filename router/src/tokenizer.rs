//! The model's tokenizer (tokenizer.json, read with the `tokenizers` crate)
//! and the special tokens chat templates refer to.
//!
//! Encoding runs on the handler's task: prompts are short next to a model
//! step, and a pool would only pay off under heavy prefill traffic.

use std::path::Path;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load {path}: {message}")]
    Load { path: String, message: String },
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
}

/// One token of an encoded text with its byte range `[start, stop)` in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedToken {
    pub id: u32,
    pub text: String,
    pub start: usize,
    pub stop: usize,
}

#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    special_ids: Arc<std::collections::HashSet<u32>>,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Ok(Self::new(inner))
    }

    pub fn new(inner: tokenizers::Tokenizer) -> Self {
        let special_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        Self {
            inner: Arc::new(inner),
            special_ids: Arc::new(special_ids),
        }
    }

    /// Token ids of `text`. `add_special_tokens` adds what the tokenizer's
    /// post-processor adds (BOS for Llama): true for raw prompts, false for
    /// chat-template output, which already spells its special tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Tokens of `text` with their byte offsets in `text` (for /tokenize).
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<EncodedToken>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError::Tokenizer(e.to_string()))?;
        Ok(encoding
            .get_ids()
            .iter()
            .zip(encoding.get_offsets())
            .map(|(&id, &(start, stop))| EncodedToken {
                id,
                text: text.get(start..stop).unwrap_or_default().to_string(),
                start,
                stop,
            })
            .collect())
    }

    /// The `tokenizers` tokenizer itself (llguidance builds its token trie
    /// from it).
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Tokenizer(e.to_string()))
    }

    /// The text of a single token as clients see it in logprob listings:
    /// its decode, special tokens spelled out.
    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id], false).unwrap_or_default()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> u32 {
        self.inner.get_vocab_size(true) as u32
    }
}
