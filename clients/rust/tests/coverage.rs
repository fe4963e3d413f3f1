//! Every RPC of the ModelExecutor service (protos/) has a `Client` method: a new RPC without a
//! helper fails here unless it is listed as a deliberate gap. No server needed.

const PROTO: &str = include_str!("../../../protos/ferrum/executor/v1/executor.proto");
const CLIENT: &str = include_str!("../src/client.rs");
const SESSION: &str = include_str!("../src/session.rs");

/// RPCs whose helpers have other names.
const RENAMED: &[(&str, &[&str])] = &[("ImportKv", &["import_kv", "pull_kv"]), ("Abort", &["abort_request", "abort_cache"])];
/// RPCs deliberately without a helper (the same list as tests/client_api_allowlist.json):
/// AcceptMigration is called by one server on another, never by a caller.
const DELIBERATE_GAPS: &[&str] = &["AcceptMigration"];

fn snake(s: &str) -> String {
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_lowercase());
    }
    out
}

#[test]
fn every_rpc_has_a_client_method() {
    let rpcs: Vec<&str> = PROTO
        .lines()
        .filter_map(|l| l.trim().strip_prefix("rpc "))
        .map(|l| l.split('(').next().unwrap().trim())
        .collect();
    assert!(rpcs.len() >= 35, "only {} rpcs parsed", rpcs.len());
    let mut missing = Vec::new();
    for r in rpcs.iter().filter(|r| !DELIBERATE_GAPS.contains(r)) {
        let names: Vec<String> = match RENAMED.iter().find(|(n, _)| n == r) {
            Some((_, ms)) => ms.iter().map(|m| m.to_string()).collect(),
            None => vec![snake(r)],
        };
        for m in names {
            if !CLIENT.contains(&format!("pub async fn {m}(")) {
                missing.push(format!("{r} ({m})"));
            }
        }
    }
    assert!(missing.is_empty(), "RPCs without a Client method: {missing:?}");
    // every Session step kind has a typed Session method
    let steps = &PROTO[PROTO.find("message SessionRequest").unwrap()..PROTO.find("message SessionResponse").unwrap()];
    let kinds: Vec<&str> = steps
        .lines()
        .filter(|l| l.trim().split_whitespace().next().is_some_and(|t| t.ends_with("Request")))
        .filter_map(|l| l.trim().split_whitespace().nth(1))
        .collect();
    assert!(kinds.len() >= 9, "{kinds:?}");
    let no_step: Vec<&&str> = kinds.iter().filter(|k| !SESSION.contains(&format!("pub async fn {k}("))).collect();
    assert!(no_step.is_empty(), "Session steps without a Session method: {no_step:?}");
}
