//! One renewal driver per `Locker`: a single task that keeps every lease of that locker alive in
//! batches and marks a lease lost before its local deadline when renewal does not get through.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::backend::Backend;
use crate::types::{LockKey, Token, drift};

/// What a lease and the driver share: the validity deadline and the lost signal.
pub(crate) struct LeaseState {
    deadline: Mutex<Instant>,
    pub(crate) lost: CancellationToken,
}

impl LeaseState {
    pub(crate) fn new(deadline: Instant) -> Arc<LeaseState> {
        Arc::new(LeaseState {
            deadline: Mutex::new(deadline),
            lost: CancellationToken::new(),
        })
    }

    pub(crate) fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the deadline forward only: a late reply of an older renewal must not shorten it.
    pub(crate) fn extend_to(&self, deadline: Instant) {
        let mut d = self.deadline.lock().unwrap_or_else(PoisonError::into_inner);
        if deadline > *d {
            *d = deadline;
        }
    }

    /// Resolves once the lease is lost: cancelled by the driver or a failed extend, or its
    /// deadline passed (the only signal a lease without renewal gets).
    pub(crate) async fn wait_lost(&self) {
        loop {
            let deadline = self.deadline();
            tokio::select! {
                _ = self.lost.cancelled() => return,
                _ = tokio::time::sleep_until(deadline) => {
                    // An extend may have moved the deadline while we slept.
                    if self.deadline() <= Instant::now() {
                        self.lost.cancel();
                        return;
                    }
                }
            }
        }
    }

    pub(crate) fn remaining(&self) -> Duration {
        if self.lost.is_cancelled() {
            return Duration::ZERO;
        }
        self.deadline().saturating_duration_since(Instant::now())
    }
}

pub(crate) enum Cmd {
    Add {
        id: u64,
        key: LockKey,
        token: Token,
        ttl: Duration,
        renew: bool,
        state: Arc<LeaseState>,
    },
    Retune {
        id: u64,
        ttl: Duration,
    },
    /// Stop tracking; with `release`, also release the lease in the background (guard dropped).
    Remove {
        id: u64,
        release: Option<(LockKey, Token)>,
    },
}

struct Entry {
    key: LockKey,
    token: Token,
    ttl: Duration,
    renew: bool,
    state: Arc<LeaseState>,
    next_renew: Instant,
    in_flight: bool,
    /// The last renewal failed: retry at `next_renew` exactly, without the batching slack.
    retrying: bool,
}

type BatchResult = (Instant, Duration, Vec<u64>, crate::Result<Vec<bool>>);

pub(crate) async fn run<B: Backend + Clone>(backend: B, mut rx: mpsc::UnboundedReceiver<Cmd>) {
    let mut entries: HashMap<u64, Entry> = HashMap::new();
    let mut inflight = FuturesUnordered::new();
    loop {
        let next_wake = entries
            .values()
            .map(|e| {
                let d = e.state.deadline();
                if e.renew && !e.in_flight {
                    d.min(e.next_renew)
                } else {
                    d
                }
            })
            .min();
        let sleep = async {
            match next_wake {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            cmd = rx.recv() => match cmd {
                None => return,
                Some(cmd) => apply(&backend, &mut entries, cmd),
            },
            Some(result) = inflight.next(), if !inflight.is_empty() => {
                settle(&mut entries, result);
            },
            _ = sleep => {},
        }
        let now = Instant::now();
        entries.retain(|_, e| {
            if e.state.deadline() <= now {
                warn!(
                    key = e.key.user(),
                    "lease lost: no renewal got through before its deadline"
                );
                e.state.lost.cancel();
                return false;
            }
            true
        });
        // Renewing early is harmless, so leases due within a sixth of their TTL join the batch;
        // that keeps many leases on few wake-ups instead of one timer each.
        let mut due: HashMap<Duration, Vec<u64>> = HashMap::new();
        for (id, e) in &entries {
            let slack = if e.retrying {
                Duration::ZERO
            } else {
                e.ttl / 6
            };
            if e.renew && !e.in_flight && e.next_renew <= now + slack {
                due.entry(e.ttl).or_default().push(*id);
            }
        }
        for (ttl, ids) in due {
            let mut items: Vec<(LockKey, Token)> = Vec::with_capacity(ids.len());
            for id in &ids {
                if let Some(e) = entries.get_mut(id) {
                    e.in_flight = true;
                    items.push((e.key.clone(), e.token.clone()));
                }
            }
            let backend = backend.clone();
            debug!(count = items.len(), ?ttl, "renewing leases");
            inflight.push(async move {
                let sent_at = Instant::now();
                let result = backend.extend(&items, ttl).await;
                (sent_at, ttl, ids, result)
            });
        }
    }
}

fn apply<B: Backend + Clone>(backend: &B, entries: &mut HashMap<u64, Entry>, cmd: Cmd) {
    match cmd {
        Cmd::Add {
            id,
            key,
            token,
            ttl,
            renew,
            state,
        } => {
            entries.insert(
                id,
                Entry {
                    key,
                    token,
                    ttl,
                    renew,
                    state,
                    next_renew: Instant::now() + ttl / 3,
                    in_flight: false,
                    retrying: false,
                },
            );
        }
        Cmd::Retune { id, ttl } => {
            if let Some(e) = entries.get_mut(&id) {
                e.ttl = ttl;
                e.next_renew = Instant::now() + ttl / 3;
            }
        }
        Cmd::Remove { id, release } => {
            entries.remove(&id);
            if let Some((key, token)) = release {
                let backend = backend.clone();
                tokio::spawn(async move {
                    match backend.release(&key, &token).await {
                        Ok(held) => debug!(key = key.user(), held, "dropped lease released"),
                        Err(e) => {
                            warn!(key = key.user(), error = %e, "dropped lease not released; it expires with its TTL")
                        }
                    }
                });
            }
        }
    }
}

fn settle(entries: &mut HashMap<u64, Entry>, (sent_at, ttl, ids, result): BatchResult) {
    match result {
        Ok(answers) => {
            for (id, held) in ids.iter().zip(answers) {
                let Some(e) = entries.get_mut(id) else {
                    continue;
                };
                e.in_flight = false;
                if held {
                    e.retrying = false;
                    e.state.extend_to(sent_at + ttl - drift(ttl));
                    e.next_renew = sent_at + e.ttl / 3;
                } else {
                    warn!(
                        key = e.key.user(),
                        "lease lost: the server no longer holds it"
                    );
                    e.state.lost.cancel();
                    entries.remove(id);
                }
            }
        }
        Err(err) => {
            for id in &ids {
                if let Some(e) = entries.get_mut(id) {
                    e.in_flight = false;
                    e.retrying = true;
                    // Retry soon; the deadline check above marks the lease lost if none succeeds.
                    e.next_renew = Instant::now() + (e.ttl / 10).min(Duration::from_millis(250));
                    debug!(key = e.key.user(), error = %err, "renewal failed; retrying");
                }
            }
        }
    }
}
