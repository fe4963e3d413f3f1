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
        self.results.iter().filter(|r| r.ok).count()
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
                if r.xfail {
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

/// Runs scenario steps against one server.
pub struct Runner {
    client: Client,
    vars: HashMap<String, Value>,
}

impl Runner {
    pub fn new(client: Client) -> Self {
        Self { client, vars: HashMap::new() }
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
            ..Default::default()
        }))
    }

    fn client_for(&self, step: &Value) -> Client {
        self.client.model(step["model"].as_str().unwrap_or(""))
    }

    /// Execute one attempt of a step: (observed, values to save by save-key).
    async fn exec(&self, step: &Value) -> Out {
        let op = step["op"].as_str().unwrap_or("");
        let c = self.client_for(step);
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
                let o = c.prefill_input(input).await?;
                let cache = o.cache.unwrap_or_default();
                let token = o.output.and_then(|x| x.token_id);
                save.insert("cache".into(), json!(cache.cache_id));
                save.insert("token".into(), json!(token));
                json!({"token": token, "num_tokens": cache.num_tokens, "model_id": cache.model_id, "cache": cache.cache_id})
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
            other => return Err(Fail::Bad(format!("unknown op {other:?}"))),
        };
        Ok((observed, save))
    }

    async fn generate(&self, c: &Client, step: &Value, save: &mut Map<String, Value>) -> Result<Value, Fail> {
        use futures_core::Stream;
        use std::pin::Pin;
        let prompt = if step["text"].is_null() {
            proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: self.tokens(step, "tokens")? })
        } else {
            proto::generate_request::Prompt::Text(self.str_arg(step, "text")?)
        };
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
            ..Default::default()
        };
        let cancel_after = step["cancel_after"].as_u64().map(|n| n as usize);
        let mut stream = c.generate(req).await?;
        let mut tokens: Vec<i32> = Vec::new();
        let mut finished: Option<proto::GenerateFinished> = None;
        let mut cancelled = false;
        loop {
            if cancel_after.is_some_and(|n| tokens.len() >= n) {
                cancelled = true;
                break;
            }
            let next = std::future::poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)).await;
            match next {
                None => break,
                Some(Err(s)) => {
                    if s.code() == Code::Cancelled {
                        cancelled = true;
                        break;
                    }
                    return Err(Fail::Rpc(s));
                }
                Some(Ok(ev)) => match ev.event {
                    Some(proto::generate_response::Event::Started(s)) => {
                        save.insert("cache".into(), json!(s.cache.map(|c| c.cache_id).unwrap_or_default()));
                    }
                    Some(proto::generate_response::Event::Token(t)) => tokens.push(t.token_id),
                    Some(proto::generate_response::Event::Finished(f)) => {
                        finished = Some(f);
                        break;
                    }
                    None => {}
                },
            }
        }
        drop(stream); // cancels the call when it is still open
        save.insert("tokens".into(), json!(tokens));
        let mut o = json!({"tokens": tokens, "cancelled": cancelled, "finish_reason": null,
                           "cache": save.get("cache").cloned().unwrap_or(Value::Null)});
        if let Some(f) = finished {
            o["finish_reason"] = json!(finish_reason_name(f.finish_reason));
            save.insert("finish_reason".into(), o["finish_reason"].clone());
            o["prompt_tokens"] = json!(f.prompt_tokens);
            o["generated_tokens"] = json!(f.generated_tokens);
            o["text"] = json!(f.text);
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
                self.vars.insert(k.clone(), v.clone());
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

/// Load a scenario, start a fresh server for it (unless `endpoint` is given), run it.
pub async fn run_scenario_file(path: &std::path::Path, endpoint: Option<String>) -> Result<Report, String> {
    run_scenario_profile(path, "", endpoint).await
}

/// [`run_scenario_file`] for one profile of the scenario (`""` = its top-level models).
pub async fn run_scenario_profile(path: &std::path::Path, profile: &str, endpoint: Option<String>) -> Result<Report, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let scenario: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let scenario = with_profile(&scenario, profile)?;
    let (_server, endpoint) = match endpoint {
        Some(e) => (None, e),
        None => {
            let mut vars = HashMap::new();
            let models = scenario["server_models"].to_string();
            if models.contains("${TINY_MODEL_DIR}") {
                vars.insert("TINY_MODEL_DIR".to_string(), crate::testing::tiny_model_dir()?.display().to_string());
            }
            if models.contains("${SMOLLM2_GGUF}") {
                vars.insert("SMOLLM2_GGUF".to_string(), crate::testing::smollm2_gguf()?.display().to_string());
            }
            let s = crate::testing::ServerProcess::start(&server_models(&scenario, &vars)).await?;
            let e = s.endpoint.clone();
            (Some(s), e)
        }
    };
    let client = Client::connect(endpoint.clone()).await.map_err(|e| format!("connect {endpoint}: {e}"))?;
    let report = Runner::new(client).run(&scenario).await;
    if let Ok(out) = std::env::var("FERRUM_CONFORMANCE_REPORT") {
        let _ = std::fs::write(&out, serde_json::to_string_pretty(&report.to_json()).unwrap_or_default());
    }
    Ok(report)
}
