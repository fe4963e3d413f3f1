//! An example scheduler over the contract, written against the typed [`Client`]:
//!
//! 1. **Continuous batching.** Requests arrive at different steps. Each step admits the arrivals
//!    with one `BatchPrefill`, then advances every running sequence with one `BatchDecode`;
//!    finished sequences leave the batch (and `ReleaseCache` frees them) while others keep going.
//! 2. **Speculative decoding with a prompt-lookup draft.** The draft is the continuation of the
//!    most recent earlier occurrence of the last n-gram in the context (no draft model). One
//!    `ForwardVerify` scores `[last, d0..dk-1]`; the longest prefix of drafts that greedy decoding
//!    agrees with is accepted, plus the target's own next token; `TruncateKv` rolls the cache back
//!    over the rejected drafts.
//!
//! 3. **A fork and a handoff.** One prompt, prefilled once, branches with `ForkCache` (the
//!    branches share its KV blocks copy-on-write) and the branches advance together in one
//!    `BatchDecode`, each fed another token; then one branch's cache is handed to a second,
//!    decode-only server (`--role decode`) with `ImportKv` by server pull, and decoding goes on
//!    there: the same tokens as on the first server.
//!
//! Runs 1 and 2 are checked against the server's own greedy `Generate`, run 3 against the first
//! server's continuation.
//!
//! ```text
//! cargo run --example scheduler     # starts two servers (tiny llama + mock; tiny on a decode-role one)
//! cargo run --example scheduler -- --endpoint http://127.0.0.1:50051 --decode-endpoint http://127.0.0.1:50052
//! ```

use std::collections::VecDeque;

use ferrum_remote_executor::proto::{self, DecodeInput, PrefillInput};
use ferrum_remote_executor::testing::{tiny_model_dir, ServerProcess};
use ferrum_remote_executor::{handoff, policy, Client, HandoffMode, ImportOptions};
use futures_util::StreamExt;

struct Request {
    name: &'static str,
    arrive_at: usize,
    prompt: String,
    max_tokens: usize,
}

struct Running {
    idx: usize,
    cache: String,
    last: i32,
    out: Vec<i32>,
}

type BoxErr = Box<dyn std::error::Error>;

async fn prompt_ids(c: &Client, has_tokenizer: bool, text: &str) -> Result<Vec<i32>, BoxErr> {
    if has_tokenizer {
        Ok(c.tokenize(text, true).await?)
    } else {
        // No tokenizer (the configurable executor): bytes as ids.
        Ok(text.bytes().map(|b| b as i32).collect())
    }
}

async fn show(c: &Client, has_tokenizer: bool, toks: &[i32]) -> String {
    if has_tokenizer {
        c.detokenize(toks, false).await.map(|t| format!("{t:?}")).unwrap_or_default()
    } else {
        String::new()
    }
}

/// The server's own greedy loop, for comparison.
async fn reference(c: &Client, prompt: &[i32], max_tokens: usize) -> Result<Vec<i32>, BoxErr> {
    let mut s = c
        .generate(proto::GenerateRequest {
            prompt: Some(proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: prompt.to_vec() })),
            stop: Some(proto::StopConditions { max_tokens: max_tokens as u32, ignore_eos: true, ..Default::default() }),
            ..Default::default()
        })
        .await?;
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        if let Some(proto::generate_response::Event::Token(t)) = ev?.event {
            out.push(t.token_id);
        }
    }
    Ok(out)
}

fn token(o: &Option<proto::LogitsOutput>) -> i32 {
    o.as_ref().and_then(|x| x.token_id).expect("a sampled token")
}

async fn continuous_batching(c: &Client, has_tokenizer: bool) -> Result<bool, BoxErr> {
    let requests = [
        Request { name: "r0", arrive_at: 0, prompt: "The quick brown fox".into(), max_tokens: 8 },
        Request { name: "r1", arrive_at: 0, prompt: "Hello world! How are".into(), max_tokens: 4 },
        Request { name: "r2", arrive_at: 2, prompt: "A KV cache stores the keys".into(), max_tokens: 6 },
        Request { name: "r3", arrive_at: 3, prompt: "Speculative decoding verifies".into(), max_tokens: 5 },
        Request { name: "r4", arrive_at: 5, prompt: "Rust, Python, C++, Go".into(), max_tokens: 3 },
    ];
    let mut prompts = Vec::new();
    for r in &requests {
        prompts.push(prompt_ids(c, has_tokenizer, &r.prompt).await?);
    }
    let mut waiting: VecDeque<usize> = (0..requests.len()).collect();
    let mut running: Vec<Running> = Vec::new();
    let mut done: Vec<(usize, Vec<i32>)> = Vec::new();
    let mut step = 0;
    println!("== continuous batching ({} requests, BatchPrefill + BatchDecode)", requests.len());
    while !waiting.is_empty() || !running.is_empty() {
        // Admit this step's arrivals with one BatchPrefill.
        let arrivals: Vec<usize> = waiting.iter().copied().filter(|&i| requests[i].arrive_at <= step).collect();
        waiting.retain(|i| !arrivals.contains(i));
        if !arrivals.is_empty() {
            let inputs = arrivals
                .iter()
                .map(|&i| PrefillInput {
                    token_ids: prompts[i].clone(),
                    logits: Some(policy::greedy()),
                    reserve_tokens: (prompts[i].len() + requests[i].max_tokens) as u64,
                    request_id: requests[i].name.to_string(),
                    ..Default::default()
                })
                .collect();
            let outs = c.batch_prefill(inputs).await?;
            for (&i, o) in arrivals.iter().zip(outs) {
                let t = token(&o.output);
                running.push(Running { idx: i, cache: o.cache.unwrap_or_default().cache_id, last: t, out: vec![t] });
            }
        }
        // Retire what is complete (the prefill token may already be the last one).
        let mut keep = Vec::new();
        for r in running.drain(..) {
            if r.out.len() >= requests[r.idx].max_tokens {
                c.release_cache(&r.cache).await?;
                done.push((r.idx, r.out));
            } else {
                keep.push(r);
            }
        }
        running = keep;
        if running.is_empty() {
            step += 1;
            continue;
        }
        // One forward for every running sequence.
        let inputs = running
            .iter()
            .map(|r| DecodeInput { cache_id: r.cache.clone(), token_id: r.last, logits: Some(policy::greedy()), ..Default::default() })
            .collect();
        let outs = c.batch_decode(inputs).await?;
        let names: Vec<&str> = running.iter().map(|r| requests[r.idx].name).collect();
        println!(
            "step {step:>2}: admitted [{}] batch_decode over [{}]",
            arrivals.iter().map(|&i| requests[i].name).collect::<Vec<_>>().join(" "),
            names.join(" ")
        );
        for (r, o) in running.iter_mut().zip(outs) {
            let t = token(&o.output);
            r.out.push(t);
            r.last = t;
        }
        step += 1;
    }
    done.sort_by_key(|(i, _)| *i);
    let mut all_ok = true;
    for (i, out) in &done {
        let want = reference(c, &prompts[*i], requests[*i].max_tokens).await?;
        let ok = &want == out;
        all_ok &= ok;
        println!(
            "{} {:?} -> {:?} {}  [{}]",
            requests[*i].name,
            requests[*i].prompt,
            out,
            show(c, has_tokenizer, out).await,
            if ok { "== Generate" } else { "DIFFERS from Generate" }
        );
    }
    Ok(all_ok)
}

/// Prompt lookup: the `k` tokens that followed the most recent earlier occurrence of the
/// context's last n-gram (n = 3, 2, 1).
fn lookup_draft(ctx: &[i32], k: usize) -> Vec<i32> {
    for n in (1..=3).rev() {
        if ctx.len() <= n {
            continue;
        }
        let tail = &ctx[ctx.len() - n..];
        for start in (0..ctx.len() - n).rev() {
            if &ctx[start..start + n] == tail {
                let from = start + n;
                let draft: Vec<i32> = ctx[from..(from + k).min(ctx.len())].to_vec();
                if !draft.is_empty() {
                    return draft;
                }
            }
        }
    }
    Vec::new()
}

/// Speculative greedy decoding of `prompt`; `compare` checks the result against `Generate`.
async fn speculative(c: &Client, has_tokenizer: bool, prompt: Vec<i32>, max_tokens: usize, compare: bool) -> Result<bool, BoxErr> {
    let k = 4;
    println!(
        "== speculative decoding on {}, prompt-lookup draft (k = {k}), ForwardVerify + TruncateKv",
        c.model_id()
    );
    let p = c.prefill(&prompt, Some(policy::greedy())).await?;
    let cache = p.cache.unwrap_or_default().cache_id;
    let mut last = token(&p.output);
    let mut out = vec![last];
    let mut ctx: Vec<i32> = prompt.iter().copied().chain([last]).collect();
    let (mut forwards, mut proposed, mut accepted_total) = (1usize, 0usize, 0usize);
    while out.len() < max_tokens {
        let draft = lookup_draft(&ctx, k.min(max_tokens - out.len()));
        forwards += 1;
        if draft.is_empty() {
            let d = c.decode(&cache, last, Some(policy::greedy())).await?;
            last = token(&d.output);
            out.push(last);
            ctx.push(last);
            println!("  decode                       -> [{last}]");
            continue;
        }
        let mut toks = vec![last];
        toks.extend(&draft);
        let v = c.forward_verify(&cache, &toks, Some(policy::greedy()), false).await?;
        let rows: Vec<i32> = v.outputs.iter().map(|o| o.token_id.expect("row token")).collect();
        let accepted = draft.iter().zip(&rows).take_while(|(d, r)| d == r).count();
        let mut new: Vec<i32> = draft[..accepted].to_vec();
        new.push(rows[accepted]);
        // Keep `last` and the accepted drafts; the correction/bonus token is fed next round.
        let keep = v.base_len as i64 + 1 + accepted as i64;
        let t = c.truncate_kv(&cache, keep).await?;
        proposed += draft.len();
        accepted_total += accepted;
        println!(
            "  verify draft {:<16} rows {:<20} accept {accepted}/{} -> {:?} (kv {} -> {})",
            format!("{draft:?}"),
            format!("{rows:?}"),
            draft.len(),
            new,
            v.cache.map_or(0, |c| c.num_tokens),
            t.cache.map_or(0, |c| c.num_tokens)
        );
        for &t in &new {
            if out.len() < max_tokens {
                out.push(t);
                ctx.push(t);
            }
        }
        last = *out.last().unwrap();
        // When the bonus token was cut by max_tokens the cache holds one token too many; the
        // request ends here anyway.
    }
    c.release_cache(&cache).await?;
    let ok = !compare || reference(c, &prompt, max_tokens).await? == out;
    println!("tokens: {out:?}");
    println!("text:   {}", show(c, has_tokenizer, &out).await);
    println!(
        "{} tokens in {} forwards ({} drafts proposed, {} accepted) [{}]",
        out.len(),
        forwards,
        proposed,
        accepted_total,
        if !compare { "not compared" } else if ok { "== Generate" } else { "DIFFERS from Generate" }
    );
    Ok(ok)
}

/// Run 3: one prompt, three branches (the cache and two forks) decoded in one batch, then one
/// branch handed to the decode server and continued there.
async fn fork_and_handoff(c: &Client, d: &Client) -> Result<bool, BoxErr> {
    let prompt: Vec<i32> = (0..40).map(|i| 1 + (i * 37) % 500).collect();
    let pre = c.prefill(&prompt, None).await?;
    let root = pre.cache.clone().unwrap().cache_id;
    let first = token(&pre.output);
    let mut branches = vec![root.clone()];
    for _ in 0..2 {
        let f = c.fork_cache(&root, None, 64).await?;
        println!("fork: {} shares {} blocks with {root}", f.cache.as_ref().unwrap().cache_id, f.shared_blocks);
        branches.push(f.cache.unwrap().cache_id);
    }
    // each branch takes another first token: the greedy one, and two others
    let firsts = [first, (first + 1) % 500, (first + 2) % 500];
    let mut last: Vec<i32> = firsts.to_vec();
    let mut outs: Vec<Vec<i32>> = firsts.iter().map(|&t| vec![t]).collect();
    for step in 0..4 {
        let inputs = branches.iter().zip(&last).map(|(b, &t)| DecodeInput { cache_id: b.clone(), token_id: t, ..Default::default() }).collect();
        let o = c.batch_decode(inputs).await?;
        for (i, r) in o.iter().enumerate() {
            last[i] = token(&r.output);
            outs[i].push(last[i]);
        }
        println!("branch step {step}: batch_decode of {} branches -> {last:?}", branches.len());
    }
    // hand branch 1 to the decode server (it pulls the K/V from this one), continue both ways
    let h = handoff(c, d, &branches[1], HandoffMode::Pull, ImportOptions { reserve_tokens: 64, ..Default::default() }, None, false).await?;
    println!("handoff: {} -> {} ({} tokens, {} bytes, {} ms)", branches[1], h.cache.cache_id, h.imported.imported_tokens, h.imported.bytes, h.handoff_ms);
    let (mut here, mut there) = (last[1], last[1]);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        here = token(&c.decode(&branches[1], here, None).await?.output);
        there = token(&d.decode(&h.cache.cache_id, there, None).await?.output);
        a.push(here);
        b.push(there);
    }
    println!("branch 1 continued here {a:?}, on the decode server {b:?}");
    d.release_cache(&h.cache.cache_id).await?;
    for br in &branches {
        c.release_cache(br).await?;
    }
    Ok(a == b && outs[0][0] == first)
}

#[tokio::main]
async fn main() -> Result<(), BoxErr> {
    let mut args = std::env::args().skip(1);
    let mut endpoint = None;
    let mut decode_endpoint = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--endpoint" => endpoint = args.next(),
            "--decode-endpoint" => decode_endpoint = args.next(),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    // Without --endpoint: a fresh server with the tiny llama ("tiny") and ferrum's configurable
    // executor ("mock"); with one, it must host both ids.
    let mut _servers = Vec::new();
    let tiny = format!("hf-causal-lm,id=tiny,path={}", tiny_model_dir()?.display());
    let endpoint = match endpoint {
        Some(e) => e,
        None => {
            let s = ServerProcess::start(&[tiny.clone(), ServerProcess::MOCK.to_string()]).await?;
            let e = s.endpoint.clone();
            _servers.push(s);
            e
        }
    };
    let decode_endpoint = match decode_endpoint {
        Some(e) => e,
        None => {
            let s = ServerProcess::start_with_args(&[tiny], &["--role".into(), "decode".into(), "--kv-peer".into(), "127.0.0.1:1024-65535".into()]).await?;
            let e = s.endpoint.clone();
            _servers.push(s);
            e
        }
    };
    let c = Client::connect(endpoint).await?.with_model("tiny");
    let d = Client::connect(decode_endpoint).await?.with_model("tiny");
    let info = c.model_info().await?;
    println!("model {} ({}, vocab {})", info.model_id, info.executor, info.vocab_size);
    let a = continuous_batching(&c, info.has_tokenizer).await?;
    let prompt = prompt_ids(&c, info.has_tokenizer, "The cat sits on the mat. The cat sits on the").await?;
    let b = speculative(&c, info.has_tokenizer, prompt, 24, true).await?;
    // ferrum's configurable executor repeats [10, 20, 30], so the lookup draft is often right:
    // this run shows acceptance and rollback. Its tokens depend on a server-wide decode counter
    // (every verified row counts), so there is no Generate comparison.
    let _ = speculative(&c.model("mock"), false, vec![10, 20, 30, 10, 20, 30], 24, false).await?;
    let f = fork_and_handoff(&c, &d).await?;
    if !(a && b) {
        return Err("scheduler output differs from the server's greedy Generate".into());
    }
    if !f {
        return Err("the handed-off branch continued differently on the decode server".into());
    }
    Ok(())
}
