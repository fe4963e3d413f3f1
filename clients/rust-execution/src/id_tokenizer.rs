//! `IdTokenizer`: ferrum 0.18's `Tokenizer` over token ids written as decimal words ("1 100 200"
//! ↔ `[1, 100, 200]`), for driving ferrum's engine with prompts the server's model already
//! tokenized, so the engine's tokens can be compared with the server's own `Generate`. The same
//! type as the 0.8 line's `ferrum_remote_executor::testing::IdTokenizer`
//! (`ferrum_remote_executor::id_tokenizer!`); `IdTokenizer::new(vocab, None)` declares no EOS, so
//! a request runs to its `max_tokens`.

ferrum_remote_executor::id_tokenizer!(ferrum_interfaces, ferrum_types);
