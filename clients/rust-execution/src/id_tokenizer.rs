//! [`IdTokenizer`]: ferrum 0.18's `Tokenizer` over token ids written as decimal words, for driving
//! ferrum's engine with prompts the server's model already tokenized (the server owns the real
//! tokenizer; the engine's text round trip must not change the ids). Used by the engine benchmark
//! and the engine tests.

use ferrum_types::{FerrumError, SpecialTokens, TokenId};

/// Token ids written as decimal words: the prompt is already tokenized (the server's model owns
/// the real tokenizer), and the engine's text round trip must not change it.
pub struct IdTokenizer {
    vocab_size: usize,
    special: SpecialTokens,
}

impl IdTokenizer {
    /// No special tokens: no EOS, so a request runs to its `max_tokens`.
    pub fn new(vocab_size: usize) -> Self {
        let special = SpecialTokens {
            bos_token: None,
            eos_token: None,
            unk_token: None,
            pad_token: None,
            sep_token: None,
            cls_token: None,
            mask_token: None,
            extra_eos_tokens: Vec::new(),
        };
        Self { vocab_size, special }
    }

    /// The prompt text that encodes to `ids`.
    pub fn text(ids: &[u32]) -> String {
        ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" ")
    }
}

impl ferrum_interfaces::Tokenizer for IdTokenizer {
    fn encode(&self, text: &str, _add_special: bool) -> ferrum_types::Result<Vec<TokenId>> {
        text.split_whitespace()
            .map(|w| w.parse::<u32>().map(TokenId::new).map_err(|e| FerrumError::invalid_parameter(format!("{w:?}: {e}"))))
            .collect()
    }

    fn decode(&self, tokens: &[TokenId], _skip_special: bool) -> ferrum_types::Result<String> {
        Ok(Self::text(&tokens.iter().map(|t| t.get()).collect::<Vec<_>>()))
    }

    fn decode_incremental(&self, prev: &[TokenId], next: TokenId) -> ferrum_types::Result<String> {
        Ok(if prev.is_empty() { next.get().to_string() } else { format!(" {}", next.get()) })
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    fn token_id(&self, text: &str) -> Option<TokenId> {
        text.trim().parse::<u32>().ok().map(TokenId::new)
    }

    fn token_text(&self, _token_id: TokenId) -> Option<&str> {
        None
    }

    fn info(&self) -> ferrum_interfaces::tokenizer::TokenizerInfo {
        ferrum_interfaces::tokenizer::TokenizerInfo {
            tokenizer_type: ferrum_interfaces::tokenizer::TokenizerType::Custom,
            vocab_size: self.vocab_size,
            special_tokens: self.special.clone(),
            supports_incremental: true,
            supports_chat_template: false,
            max_token_length: Some(16),
            model_name: Some("token-ids".into()),
        }
    }
}

