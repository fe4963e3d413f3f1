//! Runner for the language-neutral scenario `tests/conformance/scenario.json`.
//!
//! Each step names an `op` and its arguments, optionally `save`s results under names that later
//! steps reference as `"$name"` or `"$name[i]"`, and states either `expect` (fields of the
//! result; `null` in a list = any value) or `expect_code` (gRPC code name) with an optional
//! `expect_reason` (the `google.rpc.ErrorInfo` reason). `eventually_ms` retries the step until its
//! expectation holds or the time is up. The observed values of every step are kept so a run can
//! be compared token for token with the other languages' runners
//! (`FERRUM_CONFORMANCE_REPORT=path` writes them as JSON).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tonic::Code;

use crate::client::{policy, Client};
use crate::error::error_reason;
use crate::proto;

/// One step's outcome.
#[derive(Debug, Clone)]
pub struct StepResult {
    pub id: String,
    pub op: String,
    /// Passed, or failed on a step marked `known_issue` (then `xfail` is set).
    pub ok: bool,
    /// Failed, but the step is marked `known_issue` (reported as XFAIL; does not fail the run).
    pub xfail: bool,
    /// Not run: its `requires` variable is false in this profile (reported as SKIP; counted as ok).
    pub skipped: bool,
    pub message: String,
    pub millis: u128,
    /// What the step observed: result fields, or `{"code": .., "reason": ..}` for an error.
    pub observed: Value,
}

/// A whole run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub results: Vec<StepResult>,
}

impl Report {
    pub fn passed(&self) -> usize {
        self.results.iter().filter(|r| r.ok && !r.skipped).count()
    }
    /// Steps not run (`requires` false).
    pub fn skipped(&self) -> usize {
        self.results.iter().filter(|r| r.skipped).count()
    }
    pub fn failed(&self) -> usize {
        self.results.iter().filter(|r| !r.ok).count()
    }
    /// Failures on steps marked `known_issue` (counted as passed).
    pub fn xfailed(&self) -> usize {
        self.results.iter().filter(|r| r.xfail).count()
    }
    /// One report line per step, as every runner prints them.
    pub fn lines(&self) -> Vec<String> {
        self.results
            .iter()
            .map(|r| {
                if r.skipped {
                    format!("SKIP {} ({}): {}", r.id, r.op, r.message)
                } else if r.xfail {
                    format!("XFAIL {} ({}, {} ms): {}", r.id, r.op, r.millis, r.message)
                } else if r.ok {
                    format!("PASS {} ({}, {} ms)", r.id, r.op, r.millis)
                } else {
                    format!("FAIL {} ({}, {} ms): {}", r.id, r.op, r.millis, r.message)
                }
            })
            .collect()
    }
    /// `{"steps": [{"id", "op", "ok", "message", "observed"}], "passed", "failed"}`.
    pub fn to_json(&self) -> Value {
        json!({
            "passed": self.passed(),
            "failed": self.failed(),
            "steps": self.results.iter().map(|r| json!({
                "id": r.id, "op": r.op, "ok": r.ok, "xfail": r.xfail, "message": r.message, "observed": r.observed, "ms": r.millis,
            })).collect::<Vec<_>>(),
        })
    }
}

/// The scenario's `server_models`, with `${VAR}` replaced from `vars` (e.g. `TINY_MODEL_DIR`).
pub fn server_models(scenario: &Value, vars: &HashMap<String, String>) -> Vec<String> {
    scenario["server_models"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m.as_str())
                .map(|m| {
                    let mut s = m.to_string();
                    for (k, v) in vars {
                        s = s.replace(&format!("${{{k}}}"), v);
                    }
                    s
                })
                .collect()
        })
        .unwrap_or_default()
}

fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

fn finish_reason_name(v: i32) -> String {
    proto::FinishReason::try_from(v)
        .map(|r| r.as_str_name().trim_start_matches("FINISH_REASON_").to_string())
        .unwrap_or_else(|_| v.to_string())
}

/// Failure of one attempt: a gRPC error (compared against `expect_code`) or a runner problem.
enum Fail {
    Rpc(tonic::Status),
    Bad(String),
}

impl From<tonic::Status> for Fail {
    fn from(s: tonic::Status) -> Self {
        Fail::Rpc(s)
    }
}

type Out = Result<(Value, Map<String, Value>), Fail>;

/// Runs scenario steps against one server (and a peer for the KV handoff steps).
pub struct Runner {
    client: Client,
    peer: Option<Client>,
    vars: HashMap<String, Value>,
}

impl Runner {
    pub fn new(client: Client) -> Self {
        Self { client, peer: None, vars: HashMap::new() }
    }

    /// The second server of the KV handoff steps (`"server": "peer"`, `"to": "peer"`).
    pub fn with_peer(mut self, peer: Client) -> Self {
        self.peer = Some(peer);
        self
    }

    /// Seed variables (a profile's, placeholders filled in: `harness.py vars`) over the scenario's.
    pub fn with_vars(mut self, vars: &Map<String, Value>) -> Self {
        for (k, v) in vars {
            self.vars.insert(k.clone(), v.clone());
        }
        self
    }

    fn server(&self, name: &Value) -> Result<&Client, Fail> {
        match name.as_str().unwrap_or("main") {
            "" | "main" => Ok(&self.client),
            "peer" => self.peer.as_ref().ok_or_else(|| Fail::Bad("no peer server in this run".into())),
            other => Err(Fail::Bad(format!("unknown server {other:?}"))),
        }
    }

    /// Replace `"$name"` / `"$name[i]"` references (recursively).
    fn resolve(&self, v: &Value) -> Result<Value, String> {
        match v {
            Value::String(s) if s.starts_with('$') => {
                let r = &s[1..];
                let (name, idx) = match r.find('[') {
                    Some(p) if r.ends_with(']') => (&r[..p], Some(r[p + 1..r.len() - 1].parse::<i64>().map_err(|e| format!("{s}: {e}"))?)),
                    _ => (r, None),
                };
                let base = self.vars.get(name).ok_or_else(|| format!("unknown variable {s}"))?;
                match idx {
                    None => Ok(base.clone()),
                    Some(i) => {
                        let len = base.as_array().map_or(0, |a| a.len()) as i64;
                        let j = if i < 0 { len + i } else { i };
                        (0..len)
                            .contains(&j)
                            .then(|| base[j as usize].clone())
                            .ok_or_else(|| format!("{s}: index out of range"))
                    }
                }
            }
            Value::Array(a) => Ok(Value::Array(a.iter().map(|x| self.resolve(x)).collect::<Result<_, _>>()?)),
            Value::Object(o) => Ok(Value::Object(
                o.iter().map(|(k, x)| Ok((k.clone(), self.resolve(x)?))).collect::<Result<_, String>>()?,
            )),
            other => Ok(other.clone()),
        }
    }

    fn arg(&self, step: &Value, key: &str) -> Result<Value, Fail> {
        self.resolve(&step[key]).map_err(Fail::Bad)
    }

    fn int(&self, step: &Value, key: &str) -> Result<i64, Fail> {
        self.arg(step, key)?.as_i64().ok_or_else(|| Fail::Bad(format!("{key} must be an integer")))
    }

    fn str_arg(&self, step: &Value, key: &str) -> Result<String, Fail> {
        match self.arg(step, key)? {
            Value::String(s) => Ok(s),
            other => Err(Fail::Bad(format!("{key} must be a string, got {other}"))),
        }
    }

    fn tokens(&self, step: &Value, key: &str) -> Result<Vec<i32>, Fail> {
        let v = self.arg(step, key)?;
        let a = v.as_array().ok_or_else(|| Fail::Bad(format!("{key} must be a list")))?;
        a.iter()
            .map(|t| t.as_i64().map(|x| x as i32).ok_or_else(|| Fail::Bad(format!("{key}: {t} is not a token"))))
            .collect()
    }

    fn sampling(&self, step: &Value) -> Result<Option<proto::SamplingParams>, Fail> {
        let s = self.arg(step, "sampling")?;
        if s.is_null() {
            return Ok(None);
        }
        let f = |k: &str| -> Option<f32> {
            match &s[k] {
                Value::Number(n) => n.as_f64().map(|x| x as f32),
                Value::String(t) => match t.as_str() {
                    "NaN" | "nan" => Some(f32::NAN),
                    "Infinity" | "inf" => Some(f32::INFINITY),
                    "-Infinity" | "-inf" => Some(f32::NEG_INFINITY),
                    other => other.parse().ok(),
                },
                _ => None,
            }
        };
        Ok(Some(proto::SamplingParams {
            temperature: f("temperature").unwrap_or(0.0),
            top_k: s["top_k"].as_u64().unwrap_or(0) as u32,
            top_p: f("top_p"),
            min_p: f("min_p").unwrap_or(0.0),
            repetition_penalty: f("repetition_penalty"),
            penalty_token_ids: s["penalty_token_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_i64()).map(|x| x as i32).collect())
                .unwrap_or_default(),
            seed: s["seed"].as_u64(),
            token_mask: Vec::new(),
            constraint: match &s["constraint"] {
                Value::Null => None,
                c => Some(constraint_from_json(c).map_err(Fail::Bad)?),
            },
        }))
    }

    fn client_for(&self, step: &Value) -> Result<Client, Fail> {
        Ok(self.server(&step["server"])?.model(step["model"].as_str().unwrap_or("")))
    }

    fn opt_str(&self, step: &Value, key: &str) -> Result<String, Fail> {
        if step[key].is_null() {
            Ok(String::new())
        } else {
            self.str_arg(step, key)
        }
    }

    /// Execute one attempt of a step: (observed, values to save by save-key).
    async fn exec(&self, step: &Value) -> Out {
        let op = step["op"].as_str().unwrap_or("");
        let c = self.client_for(step)?;
        let mut save = Map::new();
        let observed = match op {
            "info" => {
                let r = c.info().await?;
                let models: Map<String, Value> = r.models.iter().map(|m| (m.model_id.clone(), model_info_json(m))).collect();
                json!({"contract_version": r.contract_version, "server_version": r.server_version, "models": models})
            }
            "prefill" => {
                let mut input = proto::PrefillInput { token_ids: self.tokens(step, "tokens")?, ..Default::default() };
                if !step["cache"].is_null() {
                    input.cache_id = self.str_arg(step, "cache")?;
                }
                input.logits = Some(match self.sampling(step)? {
                    Some(s) => policy::sampled(s),
                    None => policy::greedy(),
                });
                input.cache_salt = self.opt_str(step, "cache_salt")?;
                input.bypass_prefix_cache = step["bypass_prefix_cache"].as_bool().unwrap_or(false);
                input.adapter = self.opt_str(step, "adapter")?;
                let o = c.prefill_input(input).await?;
                let cache = o.cache.unwrap_or_default();
                let token = o.output.and_then(|x| x.token_id);
                save.insert("cache".into(), json!(cache.cache_id));
                save.insert("token".into(), json!(token));
                json!({"token": token, "num_tokens": cache.num_tokens, "model_id": cache.model_id, "cache": cache.cache_id,
                       "cached_tokens": o.cached_tokens})
            }
            "decode" => {
                let mut input = proto::DecodeInput {
                    cache_id: self.str_arg(step, "cache")?,
                    token_id: self.int(step, "token")? as i32,
                    ..Default::default()
                };
                if !step["position"].is_null() {
                    input.position = Some(self.int(step, "position")? as u64);
                }
                input.logits = Some(match self.sampling(step)? {
                    Some(s) => policy::sampled(s),
                    None => policy::greedy(),
                });
                let o = c.decode_input(input).await?;
                let cache = o.cache.unwrap_or_default();
                let token = o.output.and_then(|x| x.token_id);
                save.insert("cache".into(), json!(cache.cache_id));
                save.insert("token".into(), json!(token));
                json!({"token": token, "num_tokens": cache.num_tokens, "model_id": cache.model_id, "cache": cache.cache_id})
            }
            "batch_decode" => {
                let inputs = self.arg(step, "inputs")?;
                let inputs = inputs.as_array().ok_or_else(|| Fail::Bad("inputs must be a list".into()))?;
                let mut ps = Vec::new();
                for i in inputs {
                    ps.push(proto::DecodeInput {
                        cache_id: i["cache"].as_str().ok_or_else(|| Fail::Bad("inputs[].cache".into()))?.to_string(),
                        token_id: i["token"].as_i64().ok_or_else(|| Fail::Bad("inputs[].token".into()))? as i32,
                        position: i["position"].as_u64(),
                        logits: Some(match self.sampling(i)? {
                            Some(s) => policy::sampled(s),
                            None => policy::greedy(),
                        }),
                        ..Default::default()
                    });
                }
                let outs = c.batch_decode(ps).await?;
                let tokens: Vec<Value> = outs.iter().map(|o| json!(o.output.as_ref().and_then(|x| x.token_id))).collect();
                let nums: Vec<u64> = outs.iter().map(|o| o.cache.as_ref().map_or(0, |c| c.num_tokens)).collect();
                let caches: Vec<String> = outs.iter().map(|o| o.cache.as_ref().map(|c| c.cache_id.clone()).unwrap_or_default()).collect();
                save.insert("tokens".into(), json!(tokens));
                save.insert("num_tokens".into(), json!(nums));
                save.insert("caches".into(), json!(caches));
                json!({"tokens": tokens, "num_tokens": nums, "caches": caches})
            }
            "truncate" => {
                let r = c.truncate_kv(&self.str_arg(step, "cache")?, self.int(step, "new_len")?).await?;
                json!({"num_tokens": r.cache.map_or(0, |c| c.num_tokens), "removed_tokens": r.removed_tokens})
            }
            "forward_verify" => {
                let accept = step["accept_greedy_prefix"].as_bool().unwrap_or(false);
                let pol = match self.sampling(step)? {
                    Some(s) => policy::sampled(s),
                    None => policy::greedy(),
                };
                let r = c.forward_verify(&self.str_arg(step, "cache")?, &self.tokens(step, "tokens")?, Some(pol), accept).await?;
                let tokens: Vec<Value> = r.outputs.iter().map(|o| json!(o.token_id)).collect();
                save.insert("tokens".into(), json!(tokens));
                json!({
                    "tokens": tokens,
                    "base_len": r.base_len,
                    "accepted_drafts": r.accepted_drafts,
                    "accepted_tokens": r.accepted_tokens,
                    "num_tokens": r.cache.map_or(0, |c| c.num_tokens),
                })
            }
            "release" => {
                let r = c.release_cache(&self.str_arg(step, "cache")?).await?;
                json!({"released": r.released, "freed_tokens": r.freed_tokens, "freed_bytes": r.freed_bytes})
            }
            "tokenize" => {
                let add = step["add_special_tokens"].as_bool().unwrap_or(false);
                let t = c.tokenize(&self.str_arg(step, "text")?, add).await?;
                save.insert("tokens".into(), json!(t));
                json!({"tokens": t})
            }
            "detokenize" => {
                let skip = step["skip_special_tokens"].as_bool().unwrap_or(false);
                let text = c.detokenize(&self.tokens(step, "tokens")?, skip).await?;
                save.insert("text".into(), json!(text));
                json!({"text": text})
            }
            "generate" => self.generate(&c, step, &mut save).await?,
            "fork" => {
                let keep = if step["keep_tokens"].is_null() { None } else { Some(self.int(step, "keep_tokens")? as u64) };
                let reserve = step["reserve_tokens"].as_u64().unwrap_or(0);
                let r = c.fork_cache(&self.str_arg(step, "cache")?, keep, reserve).await?;
                let h = r.cache.unwrap_or_default();
                json!({"cache": h.cache_id, "model_id": h.model_id, "num_tokens": h.num_tokens, "shared_blocks": r.shared_blocks})
            }
            "loads" => {
                let r = c.loads().await?;
                let model = step["model"].as_str().unwrap_or("");
                let l = r.loads.iter().find(|l| l.model_id == model).ok_or_else(|| Fail::Bad(format!("Loads has no entry for {model:?}")))?;
                json!({"kv_event_seq": r.kv_event_seq, "active_caches": l.active_caches, "cached_blocks": l.cached_blocks,
                       "block_size": l.block_size, "prefix_hit_tokens": l.prefix_hit_tokens,
                       "prefix_queried_tokens": l.prefix_queried_tokens, "resident_tokens": l.resident_tokens})
            }
            "list_caches" => {
                let r = c.list_caches().await?;
                let mut ids: Vec<String> = r.caches.into_iter().map(|h| h.cache_id).collect();
                ids.sort();
                json!({"caches": ids, "as_of_seq": r.as_of_seq})
            }
            "kv_events" => {
                let model = step["model"].as_str().unwrap_or("");
                let after = if step["after_seq"].is_null() { 0 } else { self.int(step, "after_seq")? as u64 };
                let (msgs, resync) = collect_events(&c, after).await?;
                let mut kinds = Vec::new();
                let mut caches = Vec::new();
                let mut nums = Vec::new();
                let mut stored = 0usize;
                for m in &msgs {
                    match &m.message {
                        Some(proto::subscribe_kv_events_response::Message::Event(e)) if e.model_id == model => {
                            kinds.push(proto::KvEventKind::try_from(e.kind).map(|k| k.as_str_name().trim_start_matches("KV_EVENT_KIND_").to_string()).unwrap_or_default());
                            caches.push(e.cache_id.clone());
                            nums.push(e.num_tokens);
                        }
                        Some(proto::subscribe_kv_events_response::Message::BlockEvent(b)) if b.model_id == model => {
                            if let Some(proto::kv_block_event::Data::Stored(s)) = &b.data {
                                stored += s.block_hashes.len();
                            }
                        }
                        _ => {}
                    }
                }
                json!({"kinds": kinds, "caches": caches, "num_tokens": nums, "blocks_stored": stored, "resync_required": resync})
            }
            "mirror" => {
                let model = step["model"].as_str().unwrap_or("");
                let mut mirror = crate::prefix_mirror::PrefixMirror::new();
                mirror.set_recipes(&c.model("").info().await?);
                let (msgs, resync) = collect_events(&c, 0).await?;
                if resync {
                    return Err(Fail::Bad("the server's replay buffer no longer starts at seq 1 (resync_required)".into()));
                }
                for m in &msgs {
                    mirror.apply(m);
                }
                let toks: Vec<u32> = if step["tokens"].is_null() { Vec::new() } else { self.tokens(step, "tokens")?.into_iter().map(|t| t as u32).collect() };
                let cached = mirror.cached_tokens(model, &toks, &self.opt_str(step, "cache_salt")?, &self.opt_str(step, "adapter")?);
                json!({"blocks": mirror.len(model), "cached_tokens": cached})
            }
            "abort" => {
                let r = if step["request_id"].is_null() {
                    c.abort_cache(&self.str_arg(step, "cache")?).await?
                } else {
                    c.abort_request(&self.str_arg(step, "request_id")?).await?
                };
                json!({"aborted_streams": r.aborted_streams, "released_cache": r.released_cache})
            }
            "handoff" => {
                let to = self.server(&step["to"])?.model(step["model"].as_str().unwrap_or(""));
                let mode = if step["mode"].as_str() == Some("pull") { crate::handoff::HandoffMode::Pull } else { crate::handoff::HandoffMode::Push };
                let opts = crate::client::ImportOptions { reserve_tokens: step["reserve_tokens"].as_u64().unwrap_or(0), ..Default::default() };
                let h = crate::handoff::handoff(&c, &to, &self.str_arg(step, "cache")?, mode, opts, None, false).await?;
                let r = h.imported;
                json!({"cache": h.cache.cache_id, "model_id": h.cache.model_id, "num_tokens": h.cache.num_tokens,
                       "imported_tokens": r.imported_tokens, "chunks": r.chunks, "bytes": r.bytes, "cached_blocks": r.cached_blocks})
            }
            "load_adapter" => {
                let r = c.load_adapter(&self.str_arg(step, "name")?, &self.str_arg(step, "path")?).await?;
                let a = r.adapter.unwrap_or_default();
                json!({"name": a.name, "loaded": r.loaded, "rank": a.rank})
            }
            "unload_adapter" => {
                let r = c.unload_adapter(&self.str_arg(step, "name")?).await?;
                json!({"unloaded": r.unloaded, "dropped_blocks": r.dropped_blocks})
            }
            other => return Err(Fail::Bad(format!("unknown op {other:?}"))),
        };
        Ok((observed, save))
    }

    async fn generate(&self, c: &Client, step: &Value, save: &mut Map<String, Value>) -> Result<Value, Fail> {
        let prompt = if step["text"].is_null() {
            proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: self.tokens(step, "tokens")? })
        } else {
            proto::generate_request::Prompt::Text(self.str_arg(step, "text")?)
        };
        let n = step["n"].as_u64().unwrap_or(0) as u32;
        let request_id = self.opt_str(step, "request_id")?;
        let req = proto::GenerateRequest {
            prompt: Some(prompt),
            sampling: self.sampling(step)?,
            stop: Some(proto::StopConditions {
                max_tokens: step["max_tokens"].as_u64().unwrap_or(16) as u32,
                ignore_eos: step["ignore_eos"].as_bool().unwrap_or(false),
                stop_token_ids: step["stop_token_ids"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|x| x.as_i64()).map(|x| x as i32).collect())
                    .unwrap_or_default(),
                ..Default::default()
            }),
            keep_cache: step["keep_cache"].as_bool().unwrap_or(false),
            n,
            cache_salt: self.opt_str(step, "cache_salt")?,
            bypass_prefix_cache: step["bypass_prefix_cache"].as_bool().unwrap_or(false),
            adapter: self.opt_str(step, "adapter")?,
            request_id: request_id.clone(),
            ..Default::default()
        };
        let cancel_after = step["cancel_after"].as_u64().map(|n| n as usize);
        let abort_after = step["abort_after"].as_u64().map(|n| n as usize);
        let samples_n = n.max(1) as usize;
        let mut samples: Vec<Vec<i32>> = vec![Vec::new(); samples_n];
        let mut reasons: Vec<Value> = vec![Value::Null; samples_n];
        let mut o = json!({"cancelled": false, "finish_reason": null});
        let mut count = 0usize;
        let mut end_code = "OK";
        let mut stream = match c.generate(req).await {
            Ok(s) => s,
            Err(s) if abort_after.is_some() => return Ok(json!({"end_code": code_name(s.code())})),
            Err(s) => return Err(Fail::Rpc(s)),
        };
        loop {
            if cancel_after.is_some_and(|n| count >= n) {
                o["cancelled"] = json!(true);
                break;
            }
            match stream.message().await {
                Ok(None) => break,
                Err(s) => {
                    if abort_after.is_some() {
                        end_code = code_name(s.code());
                        break;
                    }
                    if s.code() == Code::Cancelled {
                        o["cancelled"] = json!(true);
                        break;
                    }
                    return Err(Fail::Rpc(s));
                }
                Ok(Some(ev)) => match ev.event {
                    Some(proto::generate_response::Event::Started(s)) => {
                        save.insert("cache".into(), json!(s.cache.as_ref().map(|c| c.cache_id.clone()).unwrap_or_default()));
                        o["cache"] = save["cache"].clone();
                        o["prompt_tokens"] = json!(s.prompt_tokens);
                        o["cached_tokens"] = json!(s.cached_tokens);
                    }
                    Some(proto::generate_response::Event::Token(t)) => {
                        let i = t.sample_index as usize;
                        if samples.len() <= i {
                            samples.resize(i + 1, Vec::new());
                            reasons.resize(i + 1, Value::Null);
                        }
                        samples[i].push(t.token_id);
                        count += 1;
                        if abort_after == Some(count) {
                            let r = c.abort_request(&request_id).await?;
                            o["aborted_streams"] = json!(r.aborted_streams);
                        }
                    }
                    Some(proto::generate_response::Event::Finished(f)) => {
                        let i = f.sample_index as usize;
                        if reasons.len() <= i {
                            reasons.resize(i + 1, Value::Null);
                        }
                        reasons[i] = json!(finish_reason_name(f.finish_reason));
                        if i == 0 {
                            o["finish_reason"] = reasons[0].clone();
                            save.insert("finish_reason".into(), o["finish_reason"].clone());
                            o["prompt_tokens"] = json!(f.prompt_tokens);
                            o["generated_tokens"] = json!(f.generated_tokens);
                            o["text"] = json!(f.text);
                        }
                    }
                    Some(proto::generate_response::Event::Migrated(m)) => {
                        // the scenario migrates nothing (and the client follows moves itself): a failed step
                        return Err(Fail::Bad(format!("the stream migrated to {} (passed on, not followed)", m.target)));
                    }
                    None => {}
                },
            }
        }
        drop(stream); // cancels the call when it is still open
        let tokens = samples[0].clone();
        save.insert("tokens".into(), json!(tokens));
        save.insert("samples".into(), json!(samples));
        o["tokens"] = json!(tokens);
        o["samples"] = json!(samples);
        o["finish_reasons"] = json!(reasons);
        o["end_code"] = json!(end_code);
        if o.get("cache").is_none() {
            o["cache"] = Value::Null;
        }
        Ok(o)
    }

    /// Check one attempt against the step's expectation; Ok(observed) or Err(message, observed).
    fn check(&self, step: &Value, out: &Out) -> Result<(), String> {
        let want_code = step["expect_code"].as_str();
        match (out, want_code) {
            (Err(Fail::Bad(m)), _) => Err(format!("runner: {m}")),
            (Err(Fail::Rpc(s)), None) => Err(format!("unexpected error {} {:?}: {}", code_name(s.code()), error_reason(s), s.message())),
            (Err(Fail::Rpc(s)), Some(code)) => {
                if code_name(s.code()) != code {
                    return Err(format!("expected {code}, got {} ({})", code_name(s.code()), s.message()));
                }
                if let Some(reason) = step["expect_reason"].as_str() {
                    let got = error_reason(s);
                    if got.as_deref() != Some(reason) {
                        return Err(format!("expected reason {reason}, got {got:?}"));
                    }
                }
                Ok(())
            }
            (Ok((obs, _)), Some(code)) => Err(format!("expected {code}, got OK: {obs}")),
            (Ok((obs, _)), None) => {
                let exp = self.resolve(&step["expect"]).map_err(|e| format!("runner: {e}"))?;
                if exp.is_null() {
                    return Ok(());
                }
                matches(&exp, obs, "")
            }
        }
    }

    /// Run one step (with `eventually_ms` retries); saves its results on success.
    pub async fn step(&mut self, step: &Value) -> StepResult {
        let id = step["id"].as_str().unwrap_or("?").to_string();
        let op = step["op"].as_str().unwrap_or("?").to_string();
        let started = Instant::now();
        if let Some(req) = step["requires"].as_str() {
            let on = self.vars.get(req).is_some_and(|v| !(v.is_null() || *v == Value::Bool(false) || *v == json!("") || *v == json!(0)));
            if !on {
                return StepResult { id, op, ok: true, xfail: false, skipped: true, message: format!("requires {req}"), millis: 0, observed: Value::Null };
            }
        }
        let deadline = started + Duration::from_millis(step["eventually_ms"].as_u64().unwrap_or(0));
        loop {
            let out = self.exec(step).await;
            let verdict = self.check(step, &out);
            let observed = match &out {
                Ok((o, _)) => o.clone(),
                Err(Fail::Rpc(s)) => json!({"code": code_name(s.code()), "reason": error_reason(s), "message": s.message()}),
                Err(Fail::Bad(m)) => json!({"runner_error": m}),
            };
            if verdict.is_err() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            if let (Ok(()), Ok((_, saved)), Some(spec)) = (&verdict, &out, step["save"].as_object()) {
                for (what, name) in spec {
                    let v = saved.get(what).or_else(|| out.as_ref().ok().and_then(|(o, _)| o.get(what)));
                    if let (Some(v), Some(n)) = (v, name.as_str()) {
                        self.vars.insert(n.to_string(), v.clone());
                    }
                }
            }
            let known_issue = !step["known_issue"].is_null() && step["known_issue"] != Value::Bool(false);
            let xfail = verdict.is_err() && known_issue;
            return StepResult {
                id,
                op,
                ok: verdict.is_ok() || xfail,
                xfail,
                skipped: false,
                message: verdict.err().unwrap_or_default(),
                millis: started.elapsed().as_millis(),
                observed,
            };
        }
    }

    /// Run every step of `scenario` in order (a failed step does not stop the run); the
    /// scenario's `vars` are seeded first.
    pub async fn run(&mut self, scenario: &Value) -> Report {
        if let Some(vars) = scenario["vars"].as_object() {
            for (k, v) in vars {
                self.vars.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        let mut report = Report::default();
        for step in scenario["steps"].as_array().cloned().unwrap_or_default() {
            report.results.push(self.step(&step).await);
        }
        report
    }
}

/// `expected` ⊆ `observed`: objects by key, lists element-wise (`null` = any), numbers by value.
fn matches(expected: &Value, observed: &Value, path: &str) -> Result<(), String> {
    match (expected, observed) {
        (Value::Null, _) => Ok(()),
        (Value::Object(e), Value::Object(o)) => {
            for (k, ev) in e {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                match o.get(k) {
                    Some(ov) => matches(ev, ov, &p)?,
                    None => return Err(format!("{p}: expected {ev}, not observed")),
                }
            }
            Ok(())
        }
        (Value::Array(e), Value::Array(o)) => {
            if e.len() != o.len() {
                return Err(format!("{path}: expected {expected}, got {observed}"));
            }
            for (i, (ev, ov)) in e.iter().zip(o).enumerate() {
                matches(ev, ov, &format!("{path}[{i}]"))?;
            }
            Ok(())
        }
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => Ok(()),
        (a, b) if a == b => Ok(()),
        _ => Err(format!("{path}: expected {expected}, got {observed}")),
    }
}

fn model_info_json(m: &proto::ModelInfo) -> Value {
    json!({
        "model_id": m.model_id,
        "model_type": proto::ModelType::try_from(m.model_type).map(|t| t.as_str_name().trim_start_matches("MODEL_TYPE_").to_string()).unwrap_or_default(),
        "model_type_detail": m.model_type_detail,
        "num_parameters": m.num_parameters,
        "hidden_size": m.hidden_size,
        "num_layers": m.num_layers,
        "num_heads": m.num_heads,
        "num_kv_heads": m.num_kv_heads,
        "vocab_size": m.vocab_size,
        "max_sequence_length": m.max_sequence_length,
        "device": m.device,
        "version": m.version,
        "license": m.license,
        "head_dim": m.head_dim,
        "executor": m.executor,
        "eos_token_ids": m.eos_token_ids,
        "has_tokenizer": m.has_tokenizer,
        "has_chat_template": m.has_chat_template,
    })
}

/// The scenario as profile `name` runs it (`profiles.NAME` of the file): its `server_models`, its
/// `vars` over the top-level ones. `""` is the scenario as it is.
pub fn with_profile(scenario: &Value, name: &str) -> Result<Value, String> {
    if name.is_empty() {
        return Ok(scenario.clone());
    }
    let p = scenario["profiles"].get(name).ok_or_else(|| format!("no profile {name:?} in the scenario"))?;
    let mut out = scenario.clone();
    if p.get("server_models").is_some() {
        out["server_models"] = p["server_models"].clone();
    }
    let mut vars = scenario["vars"].as_object().cloned().unwrap_or_default();
    if let Some(pv) = p["vars"].as_object() {
        vars.extend(pv.clone());
    }
    out["vars"] = Value::Object(vars);
    Ok(out)
}

/// An `OutputConstraint` from proto JSON (`{"json_schema": ..}`, `{"choice": {"choices": [..]}}`, ...).
fn constraint_from_json(v: &Value) -> Result<proto::OutputConstraint, String> {
    use crate::client::constraint;
    if let Some(s) = v["json_schema"].as_str() {
        return Ok(constraint::json_schema(s));
    }
    if let Some(s) = v["regex"].as_str() {
        return Ok(constraint::regex(s));
    }
    if let Some(s) = v["ebnf_grammar"].as_str() {
        return Ok(constraint::ebnf(s));
    }
    if let Some(a) = v["choice"]["choices"].as_array() {
        return Ok(constraint::choice(a.iter().filter_map(|x| x.as_str()).map(String::from)));
    }
    Err(format!("unknown constraint {v}"))
}

/// Every event message (all models, block events too) with seq > `after_seq` up to the server's
/// current sequence number (read first from `ListCaches`), and whether the server said resync.
async fn collect_events(c: &Client, after_seq: u64) -> Result<(Vec<proto::SubscribeKvEventsResponse>, bool), Fail> {
    let all = c.model("");
    let last = all.list_caches().await?.as_of_seq;
    if last <= after_seq {
        return Ok((Vec::new(), false));
    }
    let mut stream = all.subscribe_kv_events(Some(after_seq + 1), true).await?;
    let mut msgs = Vec::new();
    let read = async {
        while let Some(m) = stream.message().await? {
            let seq = match &m.message {
                Some(proto::subscribe_kv_events_response::Message::ResyncRequired(_)) => return Ok::<bool, tonic::Status>(true),
                Some(proto::subscribe_kv_events_response::Message::Event(e)) => e.seq,
                Some(proto::subscribe_kv_events_response::Message::BlockEvent(b)) => b.seq,
                None => 0,
            };
            msgs.push(m);
            if seq >= last {
                break;
            }
        }
        Ok(false)
    };
    let resync = tokio::time::timeout(Duration::from_secs(15), read)
        .await
        .map_err(|_| Fail::Bad(format!("KV events up to seq {last} did not arrive within 15 s")))??;
    Ok((msgs, resync))
}

/// `python tests/conformance/harness.py ARGS...`'s stdout.
fn harness(args: &[&str]) -> Result<String, String> {
    let root = crate::testing::repo_root();
    let out = std::process::Command::new(crate::testing::python())
        .arg(root.join("tests/conformance/harness.py"))
        .args(args)
        .current_dir(&root)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .map_err(|e| format!("harness.py {args:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("harness.py {args:?} failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn lines(s: &str) -> Vec<String> {
    s.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()
}

/// Load a scenario, start a fresh server for it (unless `endpoint` is given), run it.
pub async fn run_scenario_file(path: &std::path::Path, endpoint: Option<String>) -> Result<Report, String> {
    run_scenario_profile(path, "", endpoint).await
}

/// [`run_scenario_file`] for one profile of the scenario (`""` = its top-level models): a fresh
/// main server (with the scenario's `server_args`) and a fresh peer (`peer.extra_args`: the KV
/// handoff destination), the profile's variables from `harness.py vars`. With `endpoint`, only
/// that server (the steps on the peer then fail).
pub async fn run_scenario_profile(path: &std::path::Path, profile: &str, endpoint: Option<String>) -> Result<Report, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let scenario: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let scenario = with_profile(&scenario, profile)?;
    let prof: Vec<&str> = if profile.is_empty() { vec![] } else { vec!["--profile", profile] };
    let with = |cmd: &str| -> Vec<String> { std::iter::once(cmd.to_string()).chain(prof.iter().map(|s| s.to_string())).collect() };
    let call = |cmd: &str| harness(&with(cmd).iter().map(String::as_str).collect::<Vec<_>>());
    let vars: Map<String, Value> = serde_json::from_str(&call("vars")?).map_err(|e| format!("harness vars: {e}"))?;
    let mut servers = Vec::new();
    let (endpoint, peer_endpoint) = match endpoint {
        Some(e) => (e, None),
        None => {
            let models = lines(&call("models")?);
            let (main_args, peer_args) = (lines(&call("server-args")?), lines(&call("peer-args")?));
            let (main, peer) = tokio::join!(
                crate::testing::ServerProcess::start_with_args(&models, &main_args),
                crate::testing::ServerProcess::start_with_args(&models, &peer_args),
            );
            let (main, peer) = (main?, peer?);
            let out = (main.endpoint.clone(), Some(peer.endpoint.clone()));
            servers.push(main);
            servers.push(peer);
            out
        }
    };
    let client = Client::connect(endpoint.clone()).await.map_err(|e| format!("connect {endpoint}: {e}"))?;
    let mut vars = vars;
    vars.insert("main_target".into(), json!(client.target()));
    let mut runner = Runner::new(client);
    if let Some(pe) = peer_endpoint {
        let peer = Client::connect(pe.clone()).await.map_err(|e| format!("connect {pe}: {e}"))?;
        vars.insert("peer_target".into(), json!(peer.target()));
        runner = runner.with_peer(peer);
    }
    let report = runner.with_vars(&vars).run(&scenario).await;
    if let Ok(out) = std::env::var("FERRUM_CONFORMANCE_REPORT") {
        let _ = std::fs::write(&out, serde_json::to_string_pretty(&report.to_json()).unwrap_or_default());
    }
    drop(servers);
    Ok(report)
}
