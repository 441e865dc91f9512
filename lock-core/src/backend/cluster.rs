//! The Redis / Valkey Cluster backend: one cluster connection (one multiplexed connection per
//! node, following the slot map) for commands and sharded pub/sub alike.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ProtocolVersion, PushInfo, PushKind, RedisFuture, Script, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::debug;

use super::Backend;
use super::redis::{EXTEND_CHUNK, RedisConfig, Scripts, ops};
use crate::backend::AcquireReply;
use crate::error::{Error, Result};
use crate::types::{LockKey, Token};
use crate::wake::{SubCmd, Subscriptions, Wakeups, Watch, watch_through};

/// The renewal script for many slots of one node (see the script for why keys are arguments).
const EXTEND_NODE: &str = include_str!("../lua/extend_node.lua");

/// Number of hash slots in a Redis / Valkey cluster.
const SLOTS: u16 = 16384;

/// A Redis or Valkey Cluster. Clones share the connection.
///
/// Every server key of one lock (`{prefix:key}:lock`, `:fence`, and the wake-up channel) shares
/// one hash tag, so each script runs in one slot. Releases wake waiters with sharded pub/sub
/// (`SPUBLISH` / `SSUBSCRIBE`, Redis 7 and Valkey), over RESP3 on the same connection; the client
/// resubscribes after a reconnect or a slot move, and every waiter of a resubscribed channel
/// retries, since a release in the gap was not seen. Renewals are grouped by node (from
/// `CLUSTER SLOTS`): one script call per node and 256 leases, slot by slot only where the slot
/// map is stale.
///
/// ```no_run
/// use lock_core::{Locker, LockOptions};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// let locker = Locker::redis_cluster(&["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"]).await?;
/// let lease = locker.acquire("orders:42", &LockOptions::default()).await?;
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ClusterBackend {
    conn: ClusterConn,
    scripts: Arc<Scripts>,
    /// Renewal across the slots of one node (`allow-cross-slot-keys`), sent per node.
    extend_cross: Arc<Script>,
    /// Which node serves each slot, for grouping renewals by node; refreshed after a miss.
    slots: Arc<Mutex<Option<Arc<SlotMap>>>>,
    wakeups: Arc<Wakeups>,
    subs: Arc<Subscriptions>,
}

/// The masters and the slot ranges they serve, from `CLUSTER SLOTS`.
struct SlotMap {
    /// For each slot, an index into `nodes`.
    owner: Vec<usize>,
    nodes: Vec<(String, u16)>,
}

impl SlotMap {
    fn parse(reply: &Value) -> Option<SlotMap> {
        let mut map = SlotMap {
            owner: vec![usize::MAX; usize::from(SLOTS)],
            nodes: Vec::new(),
        };
        let Value::Array(ranges) = reply else {
            return None;
        };
        for range in ranges {
            let Value::Array(r) = range else { return None };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (r.first(), r.get(1), r.get(2))
            else {
                return None;
            };
            let host = match master.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let Value::Int(port) = master.get(1)? else {
                return None;
            };
            let node = (host, u16::try_from(*port).ok()?);
            let idx = match map.nodes.iter().position(|n| *n == node) {
                Some(i) => i,
                None => {
                    map.nodes.push(node);
                    map.nodes.len() - 1
                }
            };
            let (start, end) = (usize::try_from(*start).ok()?, usize::try_from(*end).ok()?);
            for slot in map.owner.get_mut(start..=end)? {
                *slot = idx;
            }
        }
        Some(map)
    }
}

/// A cluster connection that never sends a request twice once the server may have run it.
///
/// redis-rs's cluster client, left to itself, sends a request again when its connection drops
/// or its reply times out, up to 16 times, although the server may have run it already; a
/// script run twice can answer differently (a release would report `NotHeld` for the lease it
/// freed, a queue would store a job twice). This connection turns that off and sends again only
/// what a node refused without running it: `MOVED` (the slot is served elsewhere; the client
/// refreshes its slot map), `ASK` (the slot is moving; the request goes to the same node again
/// until the move ends, not to the node named), `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN` and
/// `READONLY` (a write sent to a node demoted to replica). Each is sent again after a growing
/// pause (5 ms, doubling up to 200 ms) while [`RedisConfig::response_timeout`] has not passed
/// since the first send; the last send may take a response timeout of its own, so a request
/// refused over and over is answered within about twice that. A request whose connection
/// dropped or whose reply did not come in time is an error, as on one server (the lock
/// operations report it as [`Error::OutcomeUnknown`]), and so is one the client found no
/// connection for or that met `LOADING`: redis-rs hands the error of a failed slot-map refresh
/// (no connection, a node still loading) to every request in flight, including requests the
/// node may have run.
///
/// Clones share the node connections. Commands run through it with redis-rs's
/// [`AsyncCommands`](redis::AsyncCommands), [`Script::invoke_async`] or `query_async`. A
/// pipeline is sent once, whatever the answer: a node may refuse some of its commands (`ASK`
/// for keys already moved) after running others.
///
/// ```no_run
/// use lock_core::ClusterBackend;
/// use redis::AsyncCommands;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let backend = ClusterBackend::connect(&["redis://127.0.0.1:7000/"]).await?;
/// let mut conn = backend.connection();
/// // Sent again while the slot is moving or its shard fails over; an error if the
/// // connection drops after sending it, since the node may have counted it already.
/// match conn.incr::<_, _, i64>("{orders}:count", 1).await {
///     Ok(n) => println!("count {n}"),
///     Err(e) if e.is_connection_dropped() || e.is_timeout() => {
///         println!("unknown whether it counted: {e}")
///     }
///     Err(e) => return Err(e.into()),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ClusterConn {
    inner: ClusterConnection,
    /// How long refusals of requests that did not run are answered by sending again.
    patience: Duration,
}

impl ClusterConn {
    /// The underlying redis-rs connection (built with no resending of its own), for what
    /// `ConnectionLike` does not cover, such as sharded subscriptions or routing a command to
    /// a chosen node. Requests sent through it directly are not sent again on any refusal.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// let backend = lock_core::ClusterBackend::connect(&["redis://127.0.0.1:7000/"]).await?;
    /// let conn = backend.connection();
    /// let raw: &redis::cluster_async::ClusterConnection = conn.inner();
    /// # let _ = raw;
    /// # Ok(()) }
    /// ```
    pub fn inner(&self) -> &ClusterConnection {
        &self.inner
    }
}

/// The first pause before a refused request is sent again; it doubles up to [`LAST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(5);
const LAST_PAUSE: Duration = Duration::from_millis(200);

/// Whether `e` says the request was not run: a node's refusal before the command executed.
/// Anything else (a dropped connection, a timeout, an error the command itself raised) may
/// follow a run and is never resent. Nor are "no connection" and `LOADING`: redis-rs also
/// gives those (the error of a failed slot-map refresh: no node reachable, or a `PING` to a
/// node still loading) to requests already written to a node. The refusals kept here are never
/// the answer of a refresh (`CLUSTER SLOTS`, `PING`).
fn unrun(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind as S};
    matches!(
        e.kind(),
        // READONLY: a write refused by a replica; a script fails at its first write, so
        // nothing ran that changed anything.
        ErrorKind::Server(
            S::Moved | S::Ask | S::TryAgain | S::ClusterDown | S::MasterDown | S::ReadOnly
        )
    )
}

/// The pauses between sends of a refused request, while `patience` lasts.
struct Pauses {
    next: Duration,
    give_up: Instant,
}

impl Pauses {
    fn new(patience: Duration) -> Pauses {
        Pauses {
            next: FIRST_PAUSE,
            // `Duration::MAX` ("no timeout", which redis-rs's own timeouts accept) must not
            // overflow the instant.
            give_up: crate::types::deadline_after(Instant::now(), patience),
        }
    }

    /// Sleeps before the next send; false when the patience would run out first.
    async fn wait(&mut self, refused: &redis::RedisError) -> bool {
        if Instant::now() + self.next >= self.give_up {
            return false;
        }
        debug!(error = %refused, "sending again after a pause");
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(LAST_PAUSE);
        true
    }
}

impl ConnectionLike for ClusterConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut pauses = Pauses::new(self.patience);
            loop {
                match self.inner.req_packed_command(cmd).await {
                    Err(e) if unrun(&e) && pauses.wait(&e).await => {}
                    other => return other,
                }
            }
        })
    }

    /// A pipeline is sent once: a node may refuse some of its commands (`ASK` for keys already
    /// moved) after running others.
    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.inner.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

impl ClusterBackend {
    /// Connects to a cluster through any of its nodes (`redis://host:port/`), with default
    /// settings.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{ClusterBackend, Locker};
    /// let nodes = ["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"];
    /// let backend = ClusterBackend::connect(&nodes).await?;
    /// let locker = Locker::new(backend);
    /// # Ok(()) }
    /// ```
    pub async fn connect(nodes: &[&str]) -> Result<ClusterBackend> {
        ClusterBackend::connect_with(nodes, RedisConfig::default()).await
    }

    /// Connects to a cluster with explicit settings. With the `tls` feature, `rediss://` node
    /// URLs connect over TLS, trusting `config.tls_root_pem` when given (the nodes need
    /// `tls-cluster yes`, so that the slot map names their TLS ports).
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{ClusterBackend, RedisConfig};
    /// use std::time::Duration;
    /// // Refusals during a failover are sent again for up to the response timeout.
    /// let config = RedisConfig {
    ///     response_timeout: Duration::from_secs(5),
    ///     ..RedisConfig::default()
    /// };
    /// let backend = ClusterBackend::connect_with(&["redis://10.0.0.1:7000/"], config).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(nodes: &[&str], config: RedisConfig) -> Result<ClusterBackend> {
        config.validate()?;
        let (push_tx, push_rx) = mpsc::unbounded_channel::<PushInfo>();
        let builder = ClusterClientBuilder::new(nodes.to_vec())
            .use_protocol(ProtocolVersion::RESP3)
            .push_sender(push_tx)
            .response_timeout(config.response_timeout)
            .connection_timeout(config.connection_timeout)
            // The client would resend a request whose connection dropped or whose reply timed
            // out, after the server may have run it: a script run twice can answer differently
            // (a release reporting `NotHeld` for the lease it freed, a job enqueued twice).
            // `ClusterConn` resends only what the server refused unrun.
            .retries(0);
        #[cfg(feature = "tls")]
        let builder = {
            // As for one server: ring is the process's crypto provider unless the application
            // installed another.
            let _ = rustls::crypto::ring::default_provider().install_default();
            match &config.tls_root_pem {
                // `certs` turns TLS on: only for clusters reached by `rediss://`.
                Some(root) if nodes.first().is_some_and(|n| n.starts_with("rediss://")) => builder
                    .certs(redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(root.clone()),
                    }),
                _ => builder,
            }
        };
        let client = builder.build().map_err(Error::Unavailable)?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(Error::Unavailable)?;
        let wakeups = Arc::new(Wakeups::default());
        tokio::spawn(pushes(push_rx, wakeups.clone()));
        let (sub_tx, sub_rx) = mpsc::unbounded_channel();
        let conn = ClusterConn {
            inner: conn,
            patience: config.response_timeout,
        };
        tokio::spawn(subscriptions(conn.clone(), sub_rx));
        Ok(ClusterBackend {
            conn,
            scripts: Arc::new(Scripts::new()),
            extend_cross: Arc::new(Script::new(EXTEND_NODE)),
            slots: Arc::default(),
            wakeups,
            subs: Arc::new(Subscriptions::fixed(sub_tx)),
        })
    }

    /// The shared cluster connection, for callers that want to run their own commands (see
    /// [`ClusterConn`] for what it resends and what it never does).
    ///
    /// ```no_run
    /// use lock_core::ClusterBackend;
    /// use redis::AsyncCommands;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let backend = ClusterBackend::connect(&["redis://127.0.0.1:7000/"]).await?;
    /// let mut conn = backend.connection();
    /// let _: () = conn.set("greeting", "hello").await?;
    /// # Ok(()) }
    /// ```
    pub fn connection(&self) -> ClusterConn {
        self.conn.clone()
    }

    /// The cached slot map, fetched with `CLUSTER SLOTS` when there is none.
    async fn slot_map(&self) -> Option<Arc<SlotMap>> {
        if let Some(map) = self
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return Some(map);
        }
        let reply = self
            .conn
            .inner
            .clone()
            .route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )
            .await
            .ok()?;
        let map = Arc::new(SlotMap::parse(&reply)?);
        *self.slots.lock().unwrap_or_else(PoisonError::into_inner) = Some(map.clone());
        Some(map)
    }

    /// Renews `items` node by node; an answer per item (`None` where its node or slot failed)
    /// and the first error seen.
    async fn extend_all(
        &self,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> (Vec<Option<bool>>, Option<Error>) {
        // One script call per node and 256 leases: a script may touch several slots of the node
        // it runs on (`allow-cross-slot-keys`), so renewal batches as on a single server. Where
        // the slot map is stale (failover, resharding) the node refuses the batch and its leases
        // are renewed slot by slot instead, routed by the client.
        let map = self.slot_map().await;
        // Every lease is answered for within a quarter of the TTL: a node or slot that is down,
        // failing over or stuck mid-migration leaves its own leases to be retried without
        // holding back the renewal of the others.
        let deadline = Instant::now() + ttl / 4;
        // Without a map every slot is its own group; slots sort after any node index.
        let groups = group_by(items, |item| {
            let s = slot(item.0.lock_key());
            match map.as_ref().map(|m| m.owner[usize::from(s)]) {
                Some(node) if node != usize::MAX => (0, node),
                _ => (1, usize::from(s)),
            }
        });
        let mut jobs = Vec::new();
        for (&(kind, at), g) in &groups {
            let node = map
                .as_ref()
                .filter(|_| kind == 0)
                .and_then(|m| m.nodes.get(at).cloned());
            for (places, chunk) in g
                .places
                .chunks(EXTEND_CHUNK)
                .zip(g.items.chunks(EXTEND_CHUNK))
            {
                jobs.push((node.clone(), places, chunk));
            }
        }
        let calls = jobs.into_iter().map(|(node, places, chunk)| async move {
            let (answers, error) = self.extend_chunk(node, chunk, ttl, deadline).await;
            (places.iter().copied().zip(answers), error)
        });
        let mut out = vec![None; items.len()];
        let mut first_error = None;
        for (answers, error) in futures_util::future::join_all(calls).await {
            for (i, held) in answers {
                out[i] = held;
            }
            if first_error.is_none() {
                first_error = error;
            }
        }
        (out, first_error)
    }

    /// Renews `chunk` on `node` in one call, or slot by slot when there is no node or the node
    /// refused (then the slot map is dropped, to be fetched again). An answer per lease, `None`
    /// where its node or slot failed or did not answer by `deadline`, and the first error.
    async fn extend_chunk(
        &self,
        node: Option<(String, u16)>,
        chunk: &[(LockKey, Token)],
        ttl: Duration,
        deadline: Instant,
    ) -> (Vec<Option<bool>>, Option<Error>) {
        if let Some((host, port)) = node {
            match tokio::time::timeout_at(deadline, self.extend_on(host, port, chunk, ttl)).await {
                Ok(Ok(answers)) if answers.len() == chunk.len() => {
                    return (answers.into_iter().map(|n| Some(n == 1)).collect(), None);
                }
                Ok(other) => {
                    debug!(?other, "batched renewal refused; renewing slot by slot");
                    *self.slots.lock().unwrap_or_else(PoisonError::into_inner) = None;
                }
                Err(_) => {
                    debug!("renewal timed out on one node; its leases are retried");
                    return (vec![None; chunk.len()], None);
                }
            }
        }
        // Each slot answers for its own leases: one slot stuck mid-migration (or a foreign
        // type in it) must not cost the node's other slots their renewal.
        let groups = group_by(chunk, |item| slot(item.0.lock_key()));
        let calls = groups.values().map(|g| async move {
            let renewed = ops::extend(self.conn.clone(), &self.scripts, &g.items, ttl);
            (&g.places, tokio::time::timeout_at(deadline, renewed).await)
        });
        let mut out = vec![None; chunk.len()];
        let mut first_error = None;
        for (places, answer) in futures_util::future::join_all(calls).await {
            match answer {
                Ok(Ok(held)) => {
                    for (&i, held) in places.iter().zip(held) {
                        out[i] = Some(held);
                    }
                }
                Ok(Err(e)) => {
                    debug!(error = %e, "renewal failed in one slot; its leases are retried");
                    first_error.get_or_insert(e);
                }
                Err(_) => debug!("renewal timed out in one slot; its leases are retried"),
            }
        }
        (out, first_error)
    }

    /// One batched renewal script call on the node at `host:port`, loading the script there
    /// if the node does not know it.
    async fn extend_on(
        &self,
        host: String,
        port: u16,
        chunk: &[(LockKey, Token)],
        ttl: Duration,
    ) -> redis::RedisResult<Vec<i64>> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.extend_cross.get_hash())
            .arg(0)
            .arg(ttl.as_millis() as u64);
        for (key, token) in chunk {
            cmd.arg(key.lock_key()).arg(token.as_str());
        }
        let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
        let mut conn = self.conn.inner.clone();
        // A routed command reports server errors inside the value; lift them out.
        let mut reply = conn
            .route_command(cmd.clone(), route.clone())
            .await
            .and_then(Value::extract_error);
        if matches!(&reply, Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript))
        {
            let mut load = redis::cmd("SCRIPT");
            load.arg("LOAD").arg(EXTEND_NODE);
            let loaded = conn
                .route_command(load, route.clone())
                .await
                .and_then(Value::extract_error);
            if loaded.is_ok() {
                reply = conn
                    .route_command(cmd, route)
                    .await
                    .and_then(Value::extract_error);
            }
        }
        reply.and_then(|v| Ok(redis::from_redis_value::<Vec<i64>>(v)?))
    }
}

/// Renewal items, with their places in the caller's list, grouped by where they run.
#[derive(Default)]
struct Group {
    places: Vec<usize>,
    items: Vec<(LockKey, Token)>,
}

fn group_by<K: Ord>(
    items: &[(LockKey, Token)],
    key: impl Fn(&(LockKey, Token)) -> K,
) -> BTreeMap<K, Group> {
    let mut groups: BTreeMap<K, Group> = BTreeMap::new();
    for (i, item) in items.iter().enumerate() {
        let g = groups.entry(key(item)).or_default();
        g.places.push(i);
        g.items.push(item.clone());
    }
    groups
}

/// The slot of a server key: CRC16 (XMODEM) of its hash tag, modulo the slot count.
fn slot(server_key: &str) -> u16 {
    let bytes = server_key.as_bytes();
    let tagged = server_key
        .find('{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(bytes);
    crc16::State::<crc16::XMODEM>::calculate(tagged) % SLOTS
}

impl Backend for ClusterBackend {
    const NAME: &'static str = "cluster";

    async fn acquire(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<AcquireReply> {
        crate::types::validate_ttl(ttl)?;
        ops::acquire(&mut self.conn.clone(), &self.scripts, key, token, ttl).await
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool> {
        ops::release(
            &mut self.conn.clone(),
            &self.scripts,
            key,
            token,
            "SPUBLISH",
        )
        .await
    }

    /// A lease whose node failed is an error: the node's own (a refusal stays
    /// [`Error::Refused`]), or [`Error::OutcomeUnknown`] when it did not answer within a
    /// quarter of `ttl` (the extend may have landed).
    async fn extend(&self, items: &[(LockKey, Token)], ttl: Duration) -> Result<Vec<bool>> {
        crate::types::validate_ttl(ttl)?;
        let (answers, first_error) = self.extend_all(items, ttl).await;
        if let Some(i) = answers.iter().position(Option::is_none) {
            return Err(first_error.unwrap_or_else(|| Error::OutcomeUnknown {
                op: "extend",
                key: items[i].0.user().to_owned(),
                source: redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "the node did not answer the extend in time",
                )),
            }));
        }
        Ok(answers.into_iter().flatten().collect())
    }

    async fn extend_each(
        &self,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Result<Vec<Option<bool>>> {
        Ok(self.extend_all(items, ttl).await.0)
    }

    async fn admit(&self, gate_key: &str, fence: u64) -> Result<Option<u64>> {
        ops::admit(&mut self.conn.clone(), &self.scripts, gate_key, fence).await
    }

    async fn watch(&self, key: &LockKey) -> Result<Watch> {
        Ok(watch_through(&self.wakeups, &self.subs, key).await)
    }

    fn wakeups(&self) -> &Arc<Wakeups> {
        &self.wakeups
    }
}

/// Subscribes and unsubscribes in order, so that a late unsubscribe of a key's last waiter can
/// never undo the subscribe of its next first waiter.
///
/// A subscribe that was refused unrun, or whose connection dropped or timed out, is sent again
/// after a pause, within the connection's patience: subscribing twice does no harm, so unlike
/// [`ClusterConn`]'s requests this covers a lost answer too.
async fn subscriptions(conn: ClusterConn, mut rx: mpsc::UnboundedReceiver<SubCmd>) {
    let (mut sub, patience) = (conn.inner, conn.patience);
    while let Some(cmd) = rx.recv().await {
        match cmd {
            SubCmd::Subscribe(channel, ack) => {
                let mut pauses = Pauses::new(patience);
                loop {
                    match sub.ssubscribe(&channel).await {
                        Err(e)
                            if (unrun(&e) || e.is_connection_dropped() || e.is_timeout())
                                && pauses.wait(&e).await => {}
                        Err(e) => {
                            debug!(error = %e, channel, "sharded subscribe failed; the waiter keeps its timer");
                            break;
                        }
                        Ok(()) => break,
                    }
                }
                let _ = ack.send(());
            }
            SubCmd::Unsubscribe(channel) => {
                let _ = sub.sunsubscribe(&channel).await;
            }
        }
    }
}

/// Turns the connection's pushes into wake-ups.
async fn pushes(mut rx: mpsc::UnboundedReceiver<PushInfo>, wakeups: Arc<Wakeups>) {
    while let Some(push) = rx.recv().await {
        let channel = || match push.data.first() {
            Some(Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        };
        match push.kind {
            PushKind::SMessage => {
                if let Some(ch) = channel() {
                    wakeups.wake(&ch);
                }
            }
            // A (re)subscription confirmed: after a reconnect or a slot move the client
            // resubscribes, and releases in the gap went unseen, so that channel's waiters retry.
            PushKind::SSubscribe => {
                if let Some(ch) = channel() {
                    wakeups.wake(&ch);
                }
            }
            PushKind::Disconnection => wakeups.wake_all(),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::error_reply as reply;

    #[test]
    fn only_refusals_that_ran_nothing_are_sent_again() {
        for line in [
            "MOVED 3999 127.0.0.1:6381",
            "ASK 3999 127.0.0.1:6381",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "CLUSTERDOWN The cluster is down",
            "MASTERDOWN Link with MASTER is down",
            "READONLY You can't write against a read only replica.",
        ] {
            assert!(unrun(&reply(line)), "{line}");
        }
        // What redis-rs also hands to requests in flight when a slot-map refresh fails.
        assert!(!unrun(&redis::RedisError::from((
            redis::ErrorKind::ClusterConnectionNotFound,
            "No connections found",
        ))));
        // Errors raised by a command that ran, and everything the connection may have sent.
        for line in [
            "LOADING Redis is loading the dataset in memory",
            "ERR Error running script",
            "NOSCRIPT No matching script",
            "OOM command not allowed when used memory > 'maxmemory'",
            "NOPERM User has no permissions",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        ] {
            assert!(!unrun(&reply(line)), "{line}");
        }
        for kind in [
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::TimedOut,
            std::io::ErrorKind::UnexpectedEof,
        ] {
            assert!(!unrun(&std::io::Error::from(kind).into()), "{kind:?}");
        }
    }

    /// A response timeout of `Duration::MAX` is patience without end, not an overflow on every
    /// request.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn endless_patience_does_not_overflow() {
        let mut pauses = Pauses::new(Duration::MAX);
        assert!(pauses.wait(&reply("TRYAGAIN slot moving")).await);
    }

    #[test]
    fn slots_follow_the_hash_tag() {
        // The examples of the CLUSTER KEYSLOT documentation.
        assert_eq!(slot("somekey"), 11058);
        assert_eq!(slot("foo{hash_tag}"), 2515);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        // An empty tag does not count: the whole key is hashed.
        assert_eq!(
            slot("{}foo"),
            crc16::State::<crc16::XMODEM>::calculate(b"{}foo") % SLOTS
        );
        let k = LockKey::new("leasehold", "orders:1");
        assert_eq!(slot(k.lock_key()), slot(k.fence_key()));
        assert_eq!(slot(k.lock_key()), slot(k.channel()));
    }
}
