//! The queue on Redis / Valkey: every step is one script, with deadlines on the server's clock.

use std::sync::LazyLock;
use std::time::Duration;

use ::redis::{Script, Value};
use tracing::warn;

use super::{ClaimReply, JobId, JobInfo, JobState, Op, QueueCounts, Reaped, Refusal, Settled};
use crate::backend::{Backend, ClusterBackend, RedisBackend};
use crate::error::{Error, Result, classify, classify_cluster};
use crate::types::LockKey;
use crate::wake::Watch;

/// A queue script, in its standalone form (wake-ups by `PUBLISH`) and its cluster form
/// (`SPUBLISH`, which the cluster backend's sharded subscription hears).
macro_rules! queue_script {
    ($file:literal, $publish:literal) => {
        Script::new(concat!(
            "local PUBLISH = '",
            $publish,
            "'\n",
            include_str!("../lua/queue_common.lua"),
            include_str!(concat!("../lua/", $file))
        ))
    };
}

struct Scripts {
    enqueue: Script,
    claim: Script,
    complete: Script,
    retry: Script,
    fail: Script,
    extend: Script,
    reap: Script,
    purge: Script,
    inspect: Script,
}

macro_rules! scripts {
    ($publish:literal) => {
        Scripts {
            enqueue: queue_script!("queue_enqueue.lua", $publish),
            claim: queue_script!("queue_claim.lua", $publish),
            complete: queue_script!("queue_complete.lua", $publish),
            retry: queue_script!("queue_retry.lua", $publish),
            fail: queue_script!("queue_fail.lua", $publish),
            extend: queue_script!("queue_extend.lua", $publish),
            reap: queue_script!("queue_reap.lua", $publish),
            purge: queue_script!("queue_purge.lua", $publish),
            inspect: queue_script!("queue_inspect.lua", $publish),
        }
    };
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| scripts!("PUBLISH"));
static CLUSTER_SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| scripts!("SPUBLISH"));

/// Where a queue's scripts run: one server, or a cluster (every key of a queue shares its
/// hash tag, so each script stays in one slot).
pub(crate) enum Server {
    Single(RedisBackend),
    Cluster(ClusterBackend),
}

impl Server {
    fn scripts(&self) -> &'static Scripts {
        match self {
            Server::Single(_) => &SCRIPTS,
            Server::Cluster(_) => &CLUSTER_SCRIPTS,
        }
    }
}

pub(crate) struct RedisQueue {
    backend: Server,
    /// The queue's hash tag, `{prefix:name}`, for error messages.
    tag: String,
    keys: [String; 5],
    job_prefix: String,
    /// Enqueues, retries and reaps publish here. This is the release channel of the lock of the
    /// same name (`{prefix:name}:released`), reused so that the backend's one subscription
    /// connection serves queue waiters too; it shares the queue's hash tag. A lock named like
    /// the queue would only cause spurious wake-ups in both directions, which both tolerate.
    wake_key: LockKey,
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn uint(v: &Value) -> Option<u64> {
    int(v).and_then(|i| u64::try_from(i).ok())
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        _ => None,
    }
}

fn unexpected(what: &str, reply: &Value) -> Error {
    Error::Unavailable(::redis::RedisError::from((
        ::redis::ErrorKind::UnexpectedReturnType,
        "unexpected queue script reply",
        format!("{what}: {reply:?}"),
    )))
}

/// Splits a reply into its status and the rest, turning the foreign-type status into
/// [`Error::WrongType`].
fn status<'a>(what: &str, reply: &'a Value) -> Result<(i64, &'a [Value])> {
    let Value::Array(items) = reply else {
        return Err(unexpected(what, reply));
    };
    let Some((head, rest)) = items.split_first() else {
        return Err(unexpected(what, reply));
    };
    let code = int(head).ok_or_else(|| unexpected(what, reply))?;
    if code == -1 {
        return Err(Error::WrongType {
            server_key: rest.first().and_then(text).unwrap_or_default(),
            found: rest.get(1).and_then(text).unwrap_or_default(),
        });
    }
    Ok((code, rest))
}

impl RedisQueue {
    pub(crate) fn new(backend: Server, prefix: &str, name: &str) -> RedisQueue {
        let tag = format!("{{{prefix}:{name}}}");
        RedisQueue {
            backend,
            keys: [
                format!("{tag}:pending"),
                format!("{tag}:active"),
                format!("{tag}:delayed"),
                format!("{tag}:dead"),
                format!("{tag}:seq"),
            ],
            job_prefix: format!("{tag}:job:"),
            wake_key: LockKey::new(prefix, name),
            tag,
        }
    }

    /// The error of a call whose task ended before it answered (its runtime shut down): it may
    /// have run.
    pub(crate) fn unanswered(&self, op: &'static str) -> Error {
        Error::OutcomeUnknown {
            op,
            key: self.tag.clone(),
            source: ::redis::RedisError::from(std::io::Error::other(
                "the call was dropped unanswered",
            )),
        }
    }

    async fn run(
        &self,
        op: &'static str,
        script: &Script,
        args: impl FnOnce(&mut ::redis::ScriptInvocation<'_>),
    ) -> Result<Value> {
        let mut inv = script.prepare_invoke();
        for k in &self.keys {
            inv.key(k);
        }
        inv.arg(&self.job_prefix).arg(self.wake_key.channel());
        args(&mut inv);
        match &self.backend {
            Server::Single(b) => (inv.invoke_async(&mut b.connection()).await)
                .map_err(|e| classify(op, &self.tag, e)),
            Server::Cluster(b) => (inv.invoke_async(&mut b.connection()).await)
                .map_err(|e| classify_cluster(op, &self.tag, e)),
        }
    }

    pub(crate) async fn enqueue(&self, payloads: &[&[u8]], max: u64) -> Result<Vec<u64>> {
        let reply = self
            .run("enqueue", &self.backend.scripts().enqueue, |inv| {
                inv.arg(max);
                for p in payloads {
                    inv.arg(*p);
                }
            })
            .await?;
        let (_, ids) = status("enqueue", &reply)?;
        let ids: Option<Vec<u64>> = ids.iter().map(uint).collect();
        match ids {
            Some(ids) if ids.len() == payloads.len() => Ok(ids),
            _ => Err(unexpected("enqueue", &reply)),
        }
    }

    pub(crate) async fn claim(&self, lease_ms: u64, holder: &str) -> Result<ClaimReply> {
        let reply = self
            .run("claim", &self.backend.scripts().claim, |inv| {
                inv.arg(lease_ms).arg(holder);
            })
            .await?;
        match status("claim", &reply)? {
            (1, [id, attempts, deadline, payload, aside @ ..]) => {
                self.warn_set_aside(aside);
                Ok(ClaimReply::Claimed {
                    id: uint(id).ok_or_else(|| unexpected("claim", &reply))?,
                    attempts: uint(attempts).ok_or_else(|| unexpected("claim", &reply))?,
                    deadline_ms: uint(deadline).ok_or_else(|| unexpected("claim", &reply))?,
                    payload: bytes(payload).ok_or_else(|| unexpected("claim", &reply))?,
                })
            }
            (0, [next, aside @ ..]) => {
                self.warn_set_aside(aside);
                Ok(ClaimReply::Empty {
                    next_due: uint(next).map(Duration::from_millis),
                })
            }
            (2, aside) => {
                self.warn_set_aside(aside);
                Ok(ClaimReply::SetAside)
            }
            _ => Err(unexpected("claim", &reply)),
        }
    }

    /// Logs the jobs a claim set aside, as `{key, what was found}` pairs (a foreign type, or a
    /// corrupt attempts field): the claim itself succeeded, so this is the only trace an
    /// operator gets of them.
    fn warn_set_aside(&self, aside: &[Value]) {
        for pair in aside.chunks(2) {
            warn!(
                queue = %self.tag,
                server_key = pair.first().and_then(text).unwrap_or_default(),
                found = pair.get(1).and_then(text).unwrap_or_default(),
                "a job key holds a foreign type or a corrupt job: its id was moved to the dead set"
            );
        }
    }

    pub(crate) async fn settle(
        &self,
        id: u64,
        attempts: u64,
        holder: &str,
        op: &Op<'_>,
    ) -> Result<std::result::Result<Settled, Refusal>> {
        let name = op.name();
        let (script, extra): (&Script, Vec<Vec<u8>>) = match *op {
            Op::Complete { keep_done_ms } => (
                &self.backend.scripts().complete,
                vec![keep_done_ms.to_string().into_bytes()],
            ),
            Op::Retry { delay_ms, error } => (
                &self.backend.scripts().retry,
                vec![delay_ms.to_string().into_bytes(), error.as_bytes().to_vec()],
            ),
            Op::Fail { reason } => (
                &self.backend.scripts().fail,
                vec![reason.as_bytes().to_vec()],
            ),
            Op::Extend { lease_ms } => (
                &self.backend.scripts().extend,
                vec![lease_ms.to_string().into_bytes()],
            ),
        };
        let reply = self
            .run(name, script, |inv| {
                inv.arg(id).arg(attempts);
                for a in &extra {
                    inv.arg(a.as_slice());
                }
                inv.arg(holder);
            })
            .await?;
        let (code, rest) = status(name, &reply)?;
        match code {
            1 => {
                let state = rest
                    .first()
                    .and_then(text)
                    .and_then(|s| JobState::parse(&s))
                    .ok_or_else(|| unexpected(name, &reply))?;
                Ok(Ok(Settled {
                    state,
                    at_ms: rest.get(1).and_then(uint),
                }))
            }
            -2 => Ok(Err(Refusal::Unknown)),
            -3 => Ok(Err(Refusal::Stale {
                current: rest
                    .first()
                    .and_then(uint)
                    .ok_or_else(|| unexpected(name, &reply))?,
            })),
            -4 => Ok(Err(Refusal::NotHeld {
                state: rest.first().and_then(text).unwrap_or_default(),
            })),
            -5 => Ok(Err(Refusal::Unissued {
                current: rest
                    .first()
                    .and_then(uint)
                    .ok_or_else(|| unexpected(name, &reply))?,
            })),
            _ => Err(unexpected(name, &reply)),
        }
    }

    /// The jobs moved, and how many expired ids left the active set (fewer than `limit`: none
    /// are left).
    pub(crate) async fn reap(&self, limit: usize) -> Result<(Vec<Reaped>, usize)> {
        let reply = self
            .run("reap", &self.backend.scripts().reap, |inv| {
                inv.arg(limit);
            })
            .await?;
        let (_, [taken, rest @ ..]) = status("reap", &reply)? else {
            return Err(unexpected("reap", &reply));
        };
        let taken = uint(taken).ok_or_else(|| unexpected("reap", &reply))?;
        let moved = rest
            .chunks(3)
            .map(|c| match c {
                // A job key of a foreign type, set aside in the dead set.
                [id, marker, found] if text(marker).as_deref() == Some("foreign") => {
                    let id = uint(id)?;
                    warn!(
                        queue = %self.tag,
                        server_key = format!("{}{id}", self.job_prefix),
                        found = text(found).unwrap_or_default(),
                        "a job key holds a foreign type: its expired id was moved to the dead set, the key left untouched"
                    );
                    Some(Reaped {
                        id: JobId(id),
                        attempts: 0,
                        to: JobState::Dead,
                    })
                }
                [id, att, to] => Some(Reaped {
                    id: JobId(uint(id)?),
                    attempts: uint(att)?,
                    to: JobState::parse(&text(to)?)?,
                }),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| unexpected("reap", &reply))?;
        Ok((moved, usize::try_from(taken).unwrap_or(usize::MAX)))
    }

    pub(crate) async fn purge_dead(&self, age_ms: u64, limit: usize) -> Result<u64> {
        let reply = self
            .run("purge_dead", &self.backend.scripts().purge, |inv| {
                inv.arg(limit).arg(age_ms);
            })
            .await?;
        match status("purge_dead", &reply)? {
            (1, [n]) => uint(n).ok_or_else(|| unexpected("purge_dead", &reply)),
            _ => Err(unexpected("purge_dead", &reply)),
        }
    }

    pub(crate) async fn counts(&self) -> Result<QueueCounts> {
        let reply = self
            .run("counts", &self.backend.scripts().inspect, |inv| {
                inv.arg("");
            })
            .await?;
        match status("counts", &reply)? {
            (1, [p, a, d, x]) => Ok(QueueCounts {
                pending: uint(p).unwrap_or_default(),
                active: uint(a).unwrap_or_default(),
                delayed: uint(d).unwrap_or_default(),
                dead: uint(x).unwrap_or_default(),
            }),
            _ => Err(unexpected("counts", &reply)),
        }
    }

    pub(crate) async fn job(&self, id: u64) -> Result<Option<JobInfo>> {
        let reply = self
            .run("job", &self.backend.scripts().inspect, |inv| {
                inv.arg(id);
            })
            .await?;
        match status("job", &reply)? {
            (-2, _) => Ok(None),
            (1, [state, att, max, error, payload, at]) => Ok(Some(JobInfo {
                id: JobId(id),
                state: text(state)
                    .and_then(|s| JobState::parse(&s))
                    .ok_or_else(|| unexpected("job", &reply))?,
                attempts: uint(att).unwrap_or_default(),
                max_attempts: uint(max).unwrap_or_default(),
                error: text(error),
                payload: bytes(payload),
                at_ms: uint(at),
            })),
            _ => Err(unexpected("job", &reply)),
        }
    }

    pub(crate) async fn watch(&self) -> Result<Watch> {
        match &self.backend {
            Server::Single(b) => b.watch(&self.wake_key).await,
            Server::Cluster(b) => b.watch(&self.wake_key).await,
        }
    }
}
