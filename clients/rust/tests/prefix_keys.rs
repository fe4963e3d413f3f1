//! The shared prefix-key vectors (tests/conformance/prefix_key_vectors.json): the recipe must
//! reproduce every case's root and block keys exactly. No server needed.

use ferrum_remote_executor::prefix_keys::{self, block_keys, chain_root, hex};
use ferrum_remote_executor::proto;
use ferrum_remote_executor::testing::repo_root;
use ferrum_remote_executor::PrefixMirror;

#[test]
fn vectors_match() {
    let path = repo_root().join("tests/conformance/prefix_key_vectors.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read the vectors")).unwrap();
    assert_eq!(v["algorithm"], prefix_keys::ALGORITHM);
    assert_eq!(v["seed"], prefix_keys::SEED);
    assert_eq!(v["extra_keys"], serde_json::json!(prefix_keys::EXTRA_KEYS));
    let cases = v["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let (m, salt, adapter) = (c["model_id"].as_str().unwrap(), c["cache_salt"].as_str().unwrap(), c["adapter"].as_str().unwrap());
        assert_eq!(hex(&chain_root(m, salt, adapter, prefix_keys::SEED)), c["root"].as_str().unwrap(), "{name}: root");
        let toks: Vec<u32> = c["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let keys: Vec<String> = block_keys(&toks, c["block_size"].as_u64().unwrap() as usize, m, salt, adapter).iter().map(|k| hex(k)).collect();
        let want: Vec<String> = c["block_keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_string()).collect();
        assert_eq!(keys, want, "{name}: block keys");
    }
}

fn stored(seq: u64, keys: &[[u8; 32]]) -> proto::SubscribeKvEventsResponse {
    proto::SubscribeKvEventsResponse {
        message: Some(proto::subscribe_kv_events_response::Message::BlockEvent(proto::KvBlockEvent {
            seq,
            model_id: "tiny".into(),
            time_unix_ns: 0,
            data: Some(proto::kv_block_event::Data::Stored(proto::KvBlockStored {
                block_hashes: keys.iter().map(|k| k.to_vec()).collect(),
                block_size: 4,
                ..Default::default()
            })),
        })),
    }
}

#[test]
fn mirror_applies_stored_removed_cleared_and_resync() {
    let mut m = PrefixMirror::new();
    let recipe = proto::PrefixCacheRecipe {
        enabled: true,
        algorithm: prefix_keys::ALGORITHM.into(),
        block_size: 4,
        seed: prefix_keys::SEED.into(),
        extra_keys: prefix_keys::EXTRA_KEYS.iter().map(|s| s.to_string()).collect(),
    };
    m.recipes.insert("tiny".into(), recipe.clone());
    let toks: Vec<u32> = (1..=9).collect();
    let keys = block_keys(&toks, 4, "tiny", "", "");
    assert!(m.apply(&stored(1, &keys)));
    assert_eq!(m.cached_tokens("tiny", &toks, "", ""), 8);
    assert_eq!(m.cached_tokens("tiny", &toks, "other", ""), 0);
    m.apply_block_event(&proto::KvBlockEvent {
        seq: 2,
        model_id: "tiny".into(),
        time_unix_ns: 0,
        data: Some(proto::kv_block_event::Data::Removed(proto::KvBlockRemoved { block_hashes: vec![keys[1].to_vec()] })),
    });
    assert_eq!(m.cached_tokens("tiny", &toks, "", ""), 4);
    m.apply_block_event(&proto::KvBlockEvent {
        seq: 3,
        model_id: "tiny".into(),
        time_unix_ns: 0,
        data: Some(proto::kv_block_event::Data::Cleared(proto::KvBlocksCleared {})),
    });
    assert_eq!(m.len("tiny"), 0);
    m.apply(&stored(4, &keys));
    assert_eq!(m.last_seq, 4);
    m.apply(&proto::SubscribeKvEventsResponse {
        message: Some(proto::subscribe_kv_events_response::Message::ResyncRequired(proto::ResyncRequired::default())),
    });
    assert_eq!((m.len("tiny"), m.resyncs), (0, 1));
    // recipes this client does not compute key nothing
    assert!(!prefix_keys::recipe_usable(&proto::PrefixCacheRecipe { algorithm: "other".into(), ..recipe.clone() }, ""));
    assert!(!prefix_keys::recipe_usable(&proto::PrefixCacheRecipe { extra_keys: vec!["model_id".into(), "cache_salt".into()], ..recipe.clone() }, "sql"));
    assert!(!prefix_keys::recipe_usable(&proto::PrefixCacheRecipe { enabled: false, ..recipe }, ""));
}
