//! [`id_tokenizer!`]: the token-id `Tokenizer` (text *is* token ids) for either ferrum line. The
//! two lines' `Tokenizer` traits are the same shape in different crate versions (0.8.8 here, 0.18.4
//! in `clients/rust-execution`), so the type is written once and stamped out per line:
//! `ferrum_remote_executor::testing::IdTokenizer` (0.8.8) and
//! `ferrum_remote_execution::id_tokenizer::IdTokenizer` (0.18.4).

/// Defines `IdTokenizer` in the calling module against the given `ferrum_interfaces` /
/// `ferrum_types` crates: `id_tokenizer!(ferrum_interfaces, ferrum_types);`.
#[macro_export]
macro_rules! id_tokenizer {
    ($interfaces:ident, $types:ident) => {
        /// A ferrum `Tokenizer` whose text *is* token ids ("1 100 200" ↔ `[1, 100, 200]`), for driving
        /// ferrum's engine with prompts tokenized elsewhere (the server's `Tokenize` /
        /// `ApplyChatTemplate`), so the engine's tokens can be compared with the server's own `Generate`.
        /// No special tokens are added; `eos` is the stop token the engine knows (None = none).
        #[derive(Debug, Clone)]
        pub struct IdTokenizer {
            vocab_size: usize,
            special: $types::SpecialTokens,
        }

        impl IdTokenizer {
            pub fn new(vocab_size: usize, eos: Option<u32>) -> Self {
                Self {
                    vocab_size,
                    special: $types::SpecialTokens {
                        bos_token: None,
                        eos_token: eos.map($types::TokenId::new),
                        unk_token: None,
                        pad_token: None,
                        sep_token: None,
                        cls_token: None,
                        mask_token: None,
                        extra_eos_tokens: Vec::new(),
                    },
                }
            }

            /// The prompt text that encodes to `ids`.
            pub fn text(ids: &[u32]) -> String {
                ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" ")
            }
        }

        impl $interfaces::Tokenizer for IdTokenizer {
            fn encode(&self, text: &str, _add_special: bool) -> $types::Result<Vec<$types::TokenId>> {
                text.split_whitespace()
                    .map(|w| {
                        w.parse::<u32>()
                            .map($types::TokenId::new)
                            .map_err(|e| $types::FerrumError::invalid_parameter(format!("IdTokenizer: {w:?}: {e}")))
                    })
                    .collect()
            }

            fn decode(&self, tokens: &[$types::TokenId], _skip_special: bool) -> $types::Result<String> {
                Ok(Self::text(&tokens.iter().map(|t| t.get()).collect::<Vec<_>>()))
            }

            fn decode_incremental(&self, prev: &[$types::TokenId], next: $types::TokenId) -> $types::Result<String> {
                Ok(if prev.is_empty() { next.get().to_string() } else { format!(" {}", next.get()) })
            }

            fn vocab_size(&self) -> usize {
                self.vocab_size
            }

            fn special_tokens(&self) -> &$types::SpecialTokens {
                &self.special
            }

            fn token_id(&self, text: &str) -> Option<$types::TokenId> {
                text.trim().parse::<u32>().ok().map($types::TokenId::new)
            }

            fn token_text(&self, _token_id: $types::TokenId) -> Option<&str> {
                None
            }

            fn info(&self) -> $interfaces::tokenizer::TokenizerInfo {
                $interfaces::tokenizer::TokenizerInfo {
                    tokenizer_type: $interfaces::tokenizer::TokenizerType::Custom,
                    vocab_size: self.vocab_size,
                    special_tokens: self.special.clone(),
                    supports_incremental: true,
                    supports_chat_template: false,
                    max_token_length: Some(16),
                    model_name: Some("token-ids".into()),
                }
            }
        }
    };
}
