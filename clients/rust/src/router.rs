//! Prefix-aware routing over several replicas: a new request goes to the replica holding the
//! longest cached prefix of its prompt (from each replica's mirrored block events, keys by that
//! replica's advertised recipe), then to the least loaded of those (`Loads`: queued + running
//! steps, then open streams, then live caches), then round-robin. A cache lives on the replica
//! that created it: every later step of that sequence goes to the same client.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tonic::Status;

use crate::client::Client;
use crate::prefix_mirror::BlockEventFollower;
use crate::proto;

/// One replica: its client and the follower of its block events.
pub struct Replica {
    pub target: String,
    pub client: Client,
    pub follower: BlockEventFollower,
}

/// Where [`PrefixRouter::pick`] sends a request, and why.
#[derive(Clone, Debug)]
pub struct Route {
    pub index: usize,
    pub target: String,
    pub client: Client,
    /// Leading prompt tokens the replica's prefix cache holds, per its mirror (a hint).
    pub cached_tokens: usize,
    /// Its load when it was compared with others (None: no tie to break).
    pub load: Option<proto::ModelLoad>,
}

/// A load's rank: smaller = less loaded.
pub fn load_rank(l: &proto::ModelLoad) -> (u32, u32, u64, i64) {
    (l.queued_steps + l.running_steps, l.active_streams, l.active_caches, -(l.free_blocks as i64))
}

pub struct PrefixRouter {
    replicas: Vec<Replica>,
    rr: AtomicUsize,
}

impl PrefixRouter {
    /// Connect to every `http://host:port` endpoint and start following its block events.
    pub async fn connect(endpoints: &[String]) -> Result<Self, String> {
        let mut replicas = Vec::new();
        for e in endpoints {
            let client = Client::connect(e.clone()).await.map_err(|err| format!("connect {e}: {err}"))?;
            replicas.push(Replica { target: client.target().to_string(), follower: BlockEventFollower::start(client.clone(), Duration::from_millis(500)), client });
        }
        Ok(Self { replicas, rr: AtomicUsize::new(0) })
    }

    /// Wait until every replica's subscription is open.
    pub async fn wait_following(&mut self, timeout: Duration) -> bool {
        for r in &mut self.replicas {
            if !r.follower.wait_connected(timeout).await {
                return false;
            }
        }
        true
    }

    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    /// Per replica, the leading tokens of `tokens` its mirrored prefix cache holds.
    pub fn prefix_matches(&self, model_id: &str, tokens: &[u32], cache_salt: &str, adapter: &str) -> Vec<usize> {
        self.replicas.iter().map(|r| r.follower.cached_tokens(model_id, tokens, cache_salt, adapter)).collect()
    }

    /// The replica for a new request of `model_id` with prompt `tokens`.
    pub async fn pick(&self, model_id: &str, tokens: &[u32], cache_salt: &str, adapter: &str) -> Result<Route, Status> {
        if self.replicas.is_empty() {
            return Err(Status::unavailable("no replica"));
        }
        let scores = self.prefix_matches(model_id, tokens, cache_salt, adapter);
        let best = *scores.iter().max().unwrap_or(&0);
        let mut tied: Vec<usize> = (0..self.replicas.len()).filter(|&i| scores[i] == best).collect();
        let mut loads: Vec<Option<proto::ModelLoad>> = vec![None; self.replicas.len()];
        if tied.len() > 1 {
            for &i in &tied {
                loads[i] = self.replicas[i].client.model(model_id).model_load().await.ok();
            }
            let ranks: Vec<_> = tied.iter().map(|&i| loads[i].as_ref().map(load_rank)).collect();
            // an unanswered Loads ranks last
            let least = ranks.iter().flatten().min().copied();
            if let Some(least) = least {
                tied = tied.into_iter().zip(ranks).filter(|(_, r)| *r == Some(least)).map(|(i, _)| i).collect();
            }
        }
        let i = tied[self.rr.fetch_add(1, Ordering::Relaxed) % tied.len()];
        let r = &self.replicas[i];
        Ok(Route { index: i, target: r.target.clone(), client: r.client.model(model_id), cached_tokens: best, load: loads[i].clone() })
    }
}
