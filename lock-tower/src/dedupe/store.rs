//! Where completed results live: in process for the memory backend, in Redis beside the claim.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use lock_core::{AnyBackend, ClusterConn, Lease, Locker};
use redis::Script;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

/// A completed response, as stored.
#[derive(Clone, Debug)]
pub(crate) struct Record {
    pub(crate) fingerprint: String,
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
    /// The body was above the stored-body cap and was not kept.
    pub(crate) body_omitted: bool,
}

/// Why a store operation failed.
#[derive(Debug)]
pub(crate) enum StoreError {
    Backend(String),
    /// A stored result in a shape the layer never writes (changed from outside): no retry
    /// reads it better, so it is not reported as passing trouble.
    Corrupt(String),
    Unsupported,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Backend(e) => write!(f, "result store failed: {e}"),
            StoreError::Corrupt(e) => write!(f, "stored result unreadable: {e}"),
            StoreError::Unsupported => f.write_str(
                "DedupeLayer has no result store on this backend; use memory, Redis or Redis Cluster",
            ),
        }
    }
}

#[derive(Clone)]
pub(crate) enum Store {
    Memory(Arc<MemStore>),
    Redis {
        conn: lock_core::RedisConn,
        script: Arc<Script>,
    },
    Cluster {
        conn: ClusterConn,
        script: Arc<Script>,
    },
    /// A backend with no shared place for results (for example a quorum of independent
    /// servers): every request is refused as a misconfiguration (500) rather than
    /// deduplicated per process by surprise.
    Unsupported,
}

#[derive(Default)]
pub(crate) struct MemStore {
    map: Mutex<HashMap<String, (Record, Instant)>>,
    puts: AtomicU64,
}

impl Store {
    pub(crate) fn for_locker(locker: &Locker) -> Store {
        match locker.backend() {
            // Kept with the backend, as Redis keeps results beside the claims: two layers over
            // one store share the claims, so they must share the results too, or a delivery
            // handled through one runs again through the other.
            AnyBackend::Memory(m) => Store::Memory(m.shared::<MemStore>()),
            AnyBackend::Redis(r) => Store::Redis {
                conn: r.connection(),
                script: store_script(),
            },
            AnyBackend::Cluster(c) => Store::Cluster {
                conn: c.connection(),
                script: store_script(),
            },
            // Backends added to lock-core after this layer have no result store yet.
            #[allow(unreachable_patterns)]
            _ => Store::Unsupported,
        }
    }

    pub(crate) async fn get(&self, result_key: &str) -> Result<Option<Record>, StoreError> {
        match self {
            Store::Memory(m) => {
                let mut map = m.map.lock().unwrap_or_else(PoisonError::into_inner);
                match map.get(result_key) {
                    Some((rec, until)) if *until > Instant::now() => Ok(Some(rec.clone())),
                    Some(_) => {
                        map.remove(result_key);
                        Ok(None)
                    }
                    None => Ok(None),
                }
            }
            Store::Redis { conn, .. } => redis_get(&mut conn.clone(), result_key).await,
            Store::Cluster { conn, .. } => redis_get(&mut conn.clone(), result_key).await,
            Store::Unsupported => Err(StoreError::Unsupported),
        }
    }

    /// Stores `rec` for `retention` if `claim` still holds its key (`lock_key` on the server);
    /// returns whether it did.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn put(
        &self,
        claim: &Lease,
        claim_ttl: Duration,
        lock_key: &str,
        result_key: &str,
        rec: &Record,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        match self {
            Store::Memory(m) => {
                // An extend succeeds only while this token holds the claim, and it pushes the
                // claim's expiry a full TTL out, so nobody else can take it before the insert
                // below (both happen in this process, microseconds apart).
                if claim.extend(claim_ttl).await.is_err() {
                    return Ok(false);
                }
                let now = Instant::now();
                let mut map = m.map.lock().unwrap_or_else(PoisonError::into_inner);
                if m.puts.fetch_add(1, Ordering::Relaxed) % 1024 == 1023 {
                    map.retain(|_, (_, until)| *until > now);
                }
                map.insert(result_key.to_owned(), (rec.clone(), now + retention));
                Ok(true)
            }
            Store::Redis { conn, script } => {
                redis_put(
                    &mut conn.clone(),
                    script,
                    claim,
                    lock_key,
                    result_key,
                    rec,
                    retention,
                )
                .await
            }
            Store::Unsupported => Err(StoreError::Unsupported),
            Store::Cluster { conn, script } => {
                redis_put(
                    &mut conn.clone(),
                    script,
                    claim,
                    lock_key,
                    result_key,
                    rec,
                    retention,
                )
                .await
            }
        }
    }
}

fn store_script() -> Arc<Script> {
    Arc::new(Script::new(include_str!("../lua/store_result.lua")))
}

async fn redis_get<C: ConnectionLike + Send>(
    conn: &mut C,
    result_key: &str,
) -> Result<Option<Record>, StoreError> {
    let fields: Vec<Option<Vec<u8>>> = redis::cmd("HMGET")
        .arg(result_key)
        .arg(&["fp", "status", "headers", "body", "omitted"])
        .query_async(conn)
        .await
        .map_err(|e| {
            // A result key of another type was written from outside, and does not expire with
            // the retention: no retry reads it better.
            if e.code() == Some("WRONGTYPE") {
                StoreError::Corrupt(format!("the result key holds another type: {e}"))
            } else {
                StoreError::Backend(e.to_string())
            }
        })?;
    decode(fields)
}

async fn redis_put<C: ConnectionLike + Send>(
    conn: &mut C,
    script: &Script,
    claim: &Lease,
    lock_key: &str,
    result_key: &str,
    rec: &Record,
    retention: Duration,
) -> Result<bool, StoreError> {
    let mut headers = Vec::new();
    for (name, value) in &rec.headers {
        headers.extend_from_slice(name.as_str().as_bytes());
        headers.push(b':');
        headers.extend_from_slice(value.as_bytes());
        headers.push(b'\n');
    }
    let stored: i64 = script
        .key(lock_key)
        .key(result_key)
        .arg(claim.token().as_str())
        .arg(retention.as_millis() as u64)
        .arg(&rec.fingerprint)
        .arg(rec.status.as_u16())
        .arg(headers)
        .arg(rec.body.as_ref())
        .arg(u8::from(rec.body_omitted))
        .invoke_async(conn)
        .await
        .map_err(|e| StoreError::Backend(e.to_string()))?;
    Ok(stored == 1)
}

fn decode(fields: Vec<Option<Vec<u8>>>) -> Result<Option<Record>, StoreError> {
    let bad = |what: &str| StoreError::Corrupt(format!("stored result has a bad {what}"));
    let mut it = fields.into_iter();
    let (Some(fp), Some(status), Some(headers), Some(body), Some(omitted)) =
        (it.next(), it.next(), it.next(), it.next(), it.next())
    else {
        return Err(bad("shape"));
    };
    let Some(fp) = fp else {
        // No record at all; but a record without its fingerprint was changed from outside,
        // and taking it for none would run the handler again for a delivery already handled.
        if status.is_some() || headers.is_some() || body.is_some() || omitted.is_some() {
            return Err(bad("shape"));
        }
        return Ok(None);
    };
    // Every field is written with the fingerprint, in one HSET: one missing, or a status no
    // response can have, is a record changed from outside, and replaying it would answer the
    // sender with something the handler never said (a 200 with an empty body, say).
    let (Some(headers), Some(body), Some(omitted)) = (headers, body, omitted) else {
        return Err(bad("shape"));
    };
    let status = status
        .and_then(|s| StatusCode::from_bytes(&s).ok())
        .ok_or_else(|| bad("status"))?;
    let body_omitted = match omitted.as_slice() {
        b"1" => true,
        b"0" => false,
        _ => return Err(bad("omitted flag")),
    };
    let mut parsed = Vec::new();
    for line in headers.split(|b| *b == b'\n') {
        if line.is_empty() {
            continue;
        }
        let colon = line
            .iter()
            .position(|b| *b == b':')
            .ok_or_else(|| bad("header"))?;
        let name = HeaderName::from_bytes(&line[..colon]).map_err(|_| bad("header name"))?;
        let value = HeaderValue::from_bytes(&line[colon + 1..]).map_err(|_| bad("header value"))?;
        parsed.push((name, value));
    }
    Ok(Some(Record {
        fingerprint: String::from_utf8(fp).map_err(|_| bad("fingerprint"))?,
        status,
        headers: parsed,
        body: Bytes::from(body),
        body_omitted,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory store keeps no result past its retention for long: every 1024th put sweeps
    /// the expired ones (nothing else reads them out).
    #[tokio::test]
    async fn expired_results_are_swept_as_more_arrive() {
        let locker = Locker::memory();
        let store = Store::for_locker(&locker);
        let Store::Memory(mem) = &store else {
            panic!("a memory locker has a memory store")
        };
        let claim = locker
            .acquire("claim", &lock_core::LockOptions::new())
            .await
            .expect("claim");
        let rec = Record {
            fingerprint: String::new(),
            status: StatusCode::OK,
            headers: Vec::new(),
            body: Bytes::new(),
            body_omitted: false,
        };
        let (ttl, short) = (Duration::from_secs(30), Duration::from_millis(1));
        let len = || mem.map.lock().unwrap_or_else(PoisonError::into_inner).len();
        for i in 0..1023 {
            let key = format!("old-{i}");
            assert!(
                store
                    .put(&claim, ttl, "", &key, &rec, short)
                    .await
                    .expect("put")
            );
        }
        assert_eq!(len(), 1023);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let long = Duration::from_secs(60);
        assert!(
            store
                .put(&claim, ttl, "", "new", &rec, long)
                .await
                .expect("put")
        );
        assert_eq!(len(), 1, "the expired results are still held");
        assert!(store.get("new").await.expect("get").is_some());
    }
}
