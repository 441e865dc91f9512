//! The Redis / Valkey Cluster backend: one cluster connection (one multiplexed connection per
//! node, following the slot map) for commands, and another for sharded pub/sub.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{Cmd, ProtocolVersion, PushInfo, PushKind, RedisFuture, Script, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, warn};

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
/// (`SPUBLISH` / `SSUBSCRIBE`, Redis 7 and Valkey), over RESP3 on a cluster connection of its
/// own; the client resubscribes after a reconnect, a channel whose slot moved is subscribed
/// again on its new node, and every waiter of a resubscribed channel retries, since a release in
/// the gap was not seen. A backend kept beyond the tokio runtime it connected on (in a static,
/// used from one `#[tokio::test]` runtime after another) connects again on the runtime of its
/// next request. Renewals are grouped by node (from
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
    nodes: Vec<Master>,
}

/// A master as `CLUSTER SLOTS` names it.
struct Master {
    /// Its node id, or its advertised address where the reply has no id: several nodes may
    /// advertise the same unusable address ("" or "?" on one port).
    id: String,
    /// Its advertised host ("" when the reply has none) and port.
    host: String,
    port: u16,
    /// One slot it serves.
    slot: u16,
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
        let text = |v: &Value| match v {
            Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        };
        for range in ranges {
            let Value::Array(r) = range else { return None };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (r.first(), r.get(1), r.get(2))
            else {
                return None;
            };
            // A null host (`cluster-preferred-endpoint-type unknown-endpoint`) is as unusable
            // as "".
            let host = match master.first()? {
                Value::Nil => String::new(),
                v => text(v)?,
            };
            let Value::Int(port) = master.get(1)? else {
                return None;
            };
            let port = u16::try_from(*port).ok()?;
            let id = master
                .get(2)
                .and_then(text)
                .unwrap_or_else(|| format!("{host}:{port}"));
            let (start, end) = (usize::try_from(*start).ok()?, usize::try_from(*end).ok()?);
            let idx = match map.nodes.iter().position(|n| n.id == id) {
                Some(i) => i,
                None => {
                    map.nodes.push(Master {
                        id,
                        host,
                        port,
                        slot: u16::try_from(start).ok()?,
                    });
                    map.nodes.len() - 1
                }
            };
            for slot in map.owner.get_mut(start..=end)? {
                *slot = idx;
            }
        }
        Some(map)
    }

    /// Where a batch for node `at` goes: to its address, which stays right when the client's
    /// own slot map is stale (a stalled master's replica took over), or, for an address no
    /// one can connect to, to the master of a slot it serves. A node that does not know its
    /// own IP (a one-node cluster) advertises "" (others "?", a wildcard or no host), which
    /// only the client, knowing whom it asked, can resolve; routed to ":port", every batch
    /// failed.
    fn route(&self, at: usize) -> Option<RoutingInfo> {
        let node = self.nodes.get(at)?;
        let unknown = ["", "?", "0.0.0.0", "::"].contains(&node.host.as_str());
        Some(RoutingInfo::SingleNode(if unknown {
            SingleNodeRoutingInfo::SpecificNode(Route::new(node.slot, SlotAddr::Master))
        } else {
            SingleNodeRoutingInfo::ByAddress {
                host: node.host.clone(),
                port: node.port,
            }
        }))
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
/// (no connection, a node still loading, a connection or login refused) to every request in
/// flight, including requests the node may have run; the lock and queue operations report
/// those as [`Error::OutcomeUnknown`] too. (A node loading its dataset answers a keyed command
/// `CLUSTERDOWN`, which is sent again; `LOADING` is its answer to the refresh's `PING`.)
///
/// Clones share the node connections. Commands run through it with redis-rs's
/// [`AsyncCommands`](redis::AsyncCommands), [`Script::invoke_async`] or `query_async`. A
/// pipeline is sent once, whatever the answer: a node may refuse some of its commands (`ASK`
/// for keys already moved) after running others.
///
/// ```no_run
/// use lock_core::ClusterBackend;
/// use lock_core::redis::AsyncCommands;
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
    link: Arc<Link>,
}

/// The connection a [`ClusterConn`] sends on, made again when the runtime it was made on has
/// shut down (redis-rs runs each cluster connection in a task of that runtime, and once the task
/// is gone every request fails unsent, "Unable to send command", for ever), and replaced when a
/// check after a timeout finds a master silent on it but answering a new one.
struct Link {
    /// How long refusals of requests that did not run are answered by sending again.
    patience: Duration,
    /// How long a check of a connection that may have gone silent waits for each answer (the
    /// slot map, each master's `PING`); a new connection gets twice this and the response
    /// timeout.
    check_patience: Duration,
    /// Whether such a check is running: one at a time.
    checking: AtomicBool,
    /// After a check that kept the connection (a master answers neither it nor a new one):
    /// no check before this instant, and the pause after the next such check.
    pause: Mutex<CheckPause>,
    /// Makes the client of each connection.
    builder: MakeBuilder,
    now: Mutex<Connected>,
    /// One reconnect at a time: the others wait for it rather than make their own.
    reconnecting: tokio::sync::Mutex<()>,
}

#[derive(Clone)]
struct Connected {
    inner: ClusterConnection,
    /// How many times the connection was made again: a request that timed out on an earlier
    /// one says nothing of the current one.
    generation: u64,
    /// Where the connection's pushes go: closed once the task taking them, started on the
    /// connection's runtime, is gone.
    pushes: mpsc::UnboundedSender<PushInfo>,
}

/// Connects with a client of its own.
///
/// With a push sender: redis-rs makes a node connection again as soon as it pushes a
/// disconnection only when the client has one; without, the first requests after a drop fail
/// before it notices. The command connection has no subscriptions, so its only pushes are
/// those disconnections, dropped by a task that ends only with its runtime (or once nobody
/// holds the connection).
async fn open(builder: ClusterClientBuilder) -> redis::RedisResult<Connected> {
    let (pushes, mut taken) = mpsc::unbounded_channel::<PushInfo>();
    let inner = builder
        .push_sender(pushes.clone())
        .build()?
        .get_async_connection()
        .await?;
    tokio::spawn(async move { while taken.recv().await.is_some() {} });
    Ok(Connected {
        inner,
        generation: 0,
        pushes,
    })
}

/// Makes a client builder for the backend's nodes and settings.
type MakeBuilder = Arc<dyn Fn() -> ClusterClientBuilder + Send + Sync>;

/// A client builder for `nodes` with `config`: a builder is used up by each client, and each
/// connection needs a client of its own (each has its own push channel).
fn client_builder(nodes: &[String], config: &RedisConfig) -> ClusterClientBuilder {
    let builder = ClusterClientBuilder::new(nodes.to_vec())
        .use_protocol(ProtocolVersion::RESP3)
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
    builder
}

impl ClusterConn {
    /// The underlying redis-rs connection (built with no resending of its own), for what
    /// `ConnectionLike` does not cover, such as routing a command to a chosen node. Requests
    /// sent through it directly are not sent again on any refusal, and their timeouts start no
    /// check of the connection; the one returned is not replaced when a check replaces this
    /// `ClusterConn`'s (ask again for the current one). Made again first when the runtime the
    /// current one was made on has shut down; that can fail as a connect does.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// let backend = lock_core::ClusterBackend::connect(&["redis://127.0.0.1:7000/"]).await?;
    /// let conn = backend.connection();
    /// let raw: lock_core::redis::cluster_async::ClusterConnection = conn.inner().await?;
    /// # let _ = raw;
    /// # Ok(()) }
    /// ```
    pub async fn inner(&self) -> Result<ClusterConnection> {
        self.live().await.map_err(Error::Unavailable)
    }

    /// The connection, made again on this runtime if the one it was made on has shut down.
    async fn live(&self) -> redis::RedisResult<ClusterConnection> {
        Ok(self.live_connected().await?.inner)
    }

    fn current(&self) -> Connected {
        self.link
            .now
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// [`live`](Self::live), with its generation.
    async fn live_connected(&self) -> redis::RedisResult<Connected> {
        let current = self.current();
        if !current.pushes.is_closed() {
            return Ok(current);
        }
        let _one = self.link.reconnecting.lock().await;
        let current = self.current();
        if !current.pushes.is_closed() {
            return Ok(current);
        }
        debug!("the cluster connection went with the runtime it was made on; connecting again");
        let mut fresh = open((self.link.builder)()).await?;
        fresh.generation = current.generation + 1;
        let mut now = self.link.now.lock().unwrap_or_else(PoisonError::into_inner);
        // A check may have replaced it meanwhile; that one is as new.
        if now.generation == current.generation {
            *now = fresh;
        }
        Ok(now.clone())
    }

    /// Checks the current connection, and makes it again if it is silent: for a caller that
    /// gave up on a request before the response timeout could fire (a renewal's deadline).
    pub(crate) fn check(&self) {
        self.timed_out(self.current().generation);
    }

    /// After a request on the `generation`th connection timed out: checks whether every master
    /// answers a `PING` on it, and if one does not, makes a new connection and takes it in its
    /// place when it answers every master the current one answers, and more.
    ///
    /// redis-rs makes a node's connection again when it drops, not when its peer is gone
    /// without closing it (a forgotten NAT flow, an address moved by a failover): the requests
    /// routed to that node would time out until the kernel gave up on the socket. A master
    /// that is itself stalled or down answers no new connection either, so the current one is
    /// kept; then no check runs for a pause (1 s, doubling to 30 s while checks keep finding
    /// nothing better), as each one makes a connection to every node.
    fn timed_out(&self, generation: u64) {
        /// Clears the flag however the check ends, also when its task is dropped unfinished
        /// (its runtime shut down): left set, it would keep every later check from starting.
        struct Checking(Arc<Link>);
        impl Drop for Checking {
            fn drop(&mut self) {
                self.0.checking.store(false, Ordering::Release);
            }
        }
        // The check runs on a task of its own: a connection used outside a runtime (which
        // redis-rs's cluster client does not support anyway) is not checked.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let current = self.current();
        let paused = self
            .link
            .pause
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .paused(Instant::now());
        if current.generation != generation
            || paused
            || self.link.checking.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let checking = Checking(self.link.clone());
        runtime.spawn(async move {
            let link = &checking.0;
            let patience = link.check_patience;
            let map = slot_map_on(&current.inner, patience).await;
            let before = match &map {
                Some(map) => answering(&current.inner, map, patience).await,
                None => Vec::new(),
            };
            if map.is_some() && before.iter().all(|a| *a) {
                // Healthy again: the next trouble starts from the first pause, not from where
                // an earlier one left it.
                *link.pause.lock().unwrap_or_else(PoisonError::into_inner) = CheckPause::new();
                return;
            }
            let kept = |why: &str| {
                let mut pause = link.pause.lock().unwrap_or_else(PoisonError::into_inner);
                let paused_for = pause.kept(Instant::now());
                warn!(pause = ?paused_for, "a cluster node stopped answering, and {why}; the connection is kept");
            };
            let connecting = connect_patience(patience, link.patience);
            let mut fresh = match tokio::time::timeout(connecting, open((link.builder)())).await {
                Ok(Ok(fresh)) => fresh,
                Ok(Err(e)) => return kept(&format!("a new connection failed ({e})")),
                Err(_) => return kept("a new connection took too long"),
            };
            let map = match map {
                Some(map) => map,
                None => match slot_map_on(&fresh.inner, patience).await {
                    Some(map) => map,
                    None => return kept("no slot map came on a new connection"),
                },
            };
            let before = if before.is_empty() {
                vec![false; map.nodes.len()]
            } else {
                before
            };
            let after = answering(&fresh.inner, &map, patience).await;
            let covers = before.iter().zip(&after).all(|(b, a)| *a || !*b);
            let count = |v: &[bool]| v.iter().filter(|a| **a).count();
            if !covers || count(&after) <= count(&before) {
                return kept("a new connection reaches it no better");
            }
            let mut now = link.now.lock().unwrap_or_else(PoisonError::into_inner);
            if now.generation == generation {
                warn!(
                    "a cluster node's connection stopped answering; the cluster connection was made again"
                );
                fresh.generation = generation + 1;
                *now = fresh;
            }
            *link.pause.lock().unwrap_or_else(PoisonError::into_inner) = CheckPause::new();
        });
    }
}

/// The pause after a check that kept the connection; it doubles up to [`LAST_CHECK_PAUSE`]
/// while checks keep finding nothing better.
const FIRST_CHECK_PAUSE: Duration = Duration::from_secs(1);
const LAST_CHECK_PAUSE: Duration = Duration::from_secs(30);

/// When connection checks may run again: none runs before `until`; `next` is the pause after
/// the next check that keeps the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CheckPause {
    until: Option<Instant>,
    next: Duration,
}

impl CheckPause {
    /// No pause, and the first one next: at the start, and after a check that helped or found
    /// every master answering (the next trouble starts from the first pause).
    fn new() -> CheckPause {
        CheckPause {
            until: None,
            next: FIRST_CHECK_PAUSE,
        }
    }

    fn paused(&self, now: Instant) -> bool {
        self.until.is_some_and(|until| now < until)
    }

    /// A check kept the connection at `now`: no check for the next pause, and the one after it
    /// twice as long. Returns the pause begun.
    fn kept(&mut self, now: Instant) -> Duration {
        let pause = self.next;
        self.until = Some(now + pause);
        self.next = (pause * 2).min(LAST_CHECK_PAUSE);
        pause
    }
}

/// The slot map as `conn` gets it from the first master to answer `CLUSTER SLOTS`. Every master
/// is asked: the map is wanted after a node stopped answering, and a node picked at random may
/// be that stalled one, which would leave the next renewal round without a map, routed by the
/// client's own map, which names the stalled node until it answers again.
async fn fetch_slot_map(conn: &ClusterConnection) -> Option<SlotMap> {
    let reply = conn
        .clone()
        .route_command(
            redis::cmd("CLUSTER").arg("SLOTS").clone(),
            RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::OneSucceeded),
            )),
        )
        .await
        .ok()?;
    SlotMap::parse(&reply)
}

/// How long a new connection may take: the connection timeout twice (on the first nodes, then
/// on the masters of the slot map they give) where a node does not answer, and the response
/// timeout for the map. Saturating: either may be `Duration::MAX` ("no timeout"), and an
/// overflow here would panic the check task at every silent spell.
fn connect_patience(connection_timeout: Duration, response_timeout: Duration) -> Duration {
    connection_timeout
        .saturating_mul(2)
        .saturating_add(response_timeout)
}

/// [`fetch_slot_map`] within `patience`.
async fn slot_map_on(conn: &ClusterConnection, patience: Duration) -> Option<SlotMap> {
    tokio::time::timeout(patience, fetch_slot_map(conn))
        .await
        .ok()
        .flatten()
}

/// Which masters of `map` answer a `PING` on `conn` within `patience`, in the map's order:
/// one master's silence does not hide how the others answer.
async fn answering(conn: &ClusterConnection, map: &SlotMap, patience: Duration) -> Vec<bool> {
    let pings = (0..map.nodes.len()).map(|at| {
        let mut conn = conn.clone();
        async move {
            let Some(route) = map.route(at) else {
                return false;
            };
            let ping = conn.route_command(redis::cmd("PING"), route);
            matches!(tokio::time::timeout(patience, ping).await, Ok(Ok(_)))
        }
    });
    futures_util::future::join_all(pings).await
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
            let Connected {
                mut inner,
                generation,
                ..
            } = self.live_connected().await?;
            let mut pauses = Pauses::new(self.link.patience);
            loop {
                match inner.req_packed_command(cmd).await {
                    Err(e) if unrun(&e) && pauses.wait(&e).await => {}
                    other => {
                        if other.as_ref().is_err_and(redis::RedisError::is_timeout) {
                            self.timed_out(generation);
                        }
                        return other;
                    }
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
        Box::pin(async move {
            let Connected {
                mut inner,
                generation,
                ..
            } = self.live_connected().await?;
            let answer = inner.req_packed_commands(pipeline, offset, count).await;
            if answer.as_ref().is_err_and(redis::RedisError::is_timeout) {
                self.timed_out(generation);
            }
            answer
        })
    }

    fn get_db(&self) -> i64 {
        // A cluster has database 0 only.
        0
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
    /// let config = RedisConfig::default().response_timeout(Duration::from_secs(5));
    /// let backend = ClusterBackend::connect_with(&["redis://10.0.0.1:7000/"], config).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(nodes: &[&str], config: RedisConfig) -> Result<ClusterBackend> {
        config.validate()?;
        let patience = config.response_timeout;
        let check_patience = config.connection_timeout;
        let nodes: Vec<String> = nodes.iter().map(|n| n.to_string()).collect();
        let builder: MakeBuilder = Arc::new(move || client_builder(&nodes, &config));
        let connected = open(builder()).await.map_err(Error::Unavailable)?;
        let conn = ClusterConn {
            link: Arc::new(Link {
                patience,
                check_patience,
                checking: AtomicBool::new(false),
                pause: Mutex::new(CheckPause::new()),
                builder,
                now: Mutex::new(connected),
                reconnecting: tokio::sync::Mutex::new(()),
            }),
        };
        let wakeups = Arc::new(Wakeups::default());
        let subs = Subscriptions::restarting({
            let (conn, wakeups) = (conn.clone(), wakeups.clone());
            move || {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(subscriber(conn.clone(), wakeups.clone(), rx));
                tx
            }
        });
        Ok(ClusterBackend {
            conn,
            scripts: Arc::new(Scripts::for_cluster()),
            extend_cross: Arc::new(Script::new(EXTEND_NODE)),
            slots: Arc::default(),
            wakeups,
            subs: Arc::new(subs),
        })
    }

    /// The shared cluster connection, for callers that want to run their own commands (see
    /// [`ClusterConn`] for what it resends and what it never does).
    ///
    /// ```no_run
    /// use lock_core::ClusterBackend;
    /// use lock_core::redis::AsyncCommands;
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
        let map = Arc::new(fetch_slot_map(&self.conn.live().await.ok()?).await?);
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
        // Every lease is answered for within a quarter of the TTL: a node or slot that is down,
        // failing over or stuck mid-migration leaves its own leases to be retried without
        // holding back the renewal of the others. The quarter counts from here, map fetch
        // included: a quarter for each would let a slow fetch make it a half, and a renewal
        // that fails then is retried too late to land.
        let deadline = Instant::now() + ttl / 4;
        // The fetch gets half of that, as the node asked may be the stalled one: without a map
        // the leases are renewed slot by slot, routed by the client, in the time left.
        let map = tokio::time::timeout(ttl / 8, self.slot_map())
            .await
            .ok()
            .flatten();
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
            let node = map.as_ref().filter(|_| kind == 0).and_then(|m| m.route(at));
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

    /// Renews `chunk` in one call on `node`, or slot by slot when there is no node or the node
    /// refused (then the slot map is dropped, to be fetched again). An answer per lease, `None`
    /// where its node or slot failed or did not answer by `deadline`, and the first error.
    async fn extend_chunk(
        &self,
        node: Option<RoutingInfo>,
        chunk: &[(LockKey, Token)],
        ttl: Duration,
        deadline: Instant,
    ) -> (Vec<Option<bool>>, Option<Error>) {
        if let Some(node) = node {
            match tokio::time::timeout_at(deadline, self.extend_on(node, chunk, ttl)).await {
                // Anything but 1 or 0 is no answer (a script out of step with this client):
                // read as "not held" it would report live leases lost, so the slot-by-slot
                // path, which refuses what it cannot read, asks again.
                Ok(Ok(answers))
                    if answers.len() == chunk.len()
                        && answers.iter().all(|&n| n == 0 || n == 1) =>
                {
                    return (answers.into_iter().map(|n| Some(n == 1)).collect(), None);
                }
                Ok(other) => {
                    debug!(?other, "batched renewal refused; renewing slot by slot");
                    *self.slots.lock().unwrap_or_else(PoisonError::into_inner) = None;
                }
                Err(_) => {
                    // A node that does not answer may be stalled while its replica takes over:
                    // the map is fetched again, so that the next round goes to the new master
                    // rather than to the same address until the leases run out.
                    debug!("renewal timed out on one node; its leases are retried");
                    *self.slots.lock().unwrap_or_else(PoisonError::into_inner) = None;
                    // Or its connection went silent, which a new connection cures.
                    self.conn.check();
                    return (vec![None; chunk.len()], None);
                }
            }
        }
        // Each slot answers for its own leases: one slot stuck mid-migration (or a foreign
        // type in it) must not cost the node's other slots their renewal.
        let groups = group_by(chunk, |item| slot(item.0.lock_key()));
        let calls = groups.values().map(|g| async move {
            let renewed = ops::extend_each(self.conn.clone(), &self.scripts, &g.items, ttl);
            (&g.places, tokio::time::timeout_at(deadline, renewed).await)
        });
        let mut out = vec![None; chunk.len()];
        let mut first_error = None;
        for (places, answer) in futures_util::future::join_all(calls).await {
            match answer {
                Ok(Ok(held)) => {
                    for (&i, held) in places.iter().zip(held) {
                        match held {
                            Ok(held) => out[i] = Some(held),
                            // Refused for this lease's key alone: retried, as a failed slot.
                            Err(e) => {
                                debug!(error = %e, "renewal refused for one lease's key; it is retried");
                                first_error.get_or_insert(e);
                            }
                        }
                    }
                }
                Ok(Err(e)) => {
                    debug!(error = %e, "renewal failed in one slot; its leases are retried");
                    first_error.get_or_insert(e);
                }
                Err(_) => {
                    debug!("renewal timed out in one slot; its leases are retried");
                    self.conn.check();
                }
            }
        }
        (out, first_error)
    }

    /// One batched renewal script call on the node `route` leads to, loading the script there
    /// if the node does not know it.
    async fn extend_on(
        &self,
        route: RoutingInfo,
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
        let mut conn = self.conn.live().await?;
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
        ops::acquire(&mut self.conn.clone(), &self.scripts, key, token, ttl, None).await
    }

    async fn acquire_keeping_fence(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        keep: Duration,
    ) -> Result<AcquireReply> {
        crate::types::validate_ttl(ttl)?;
        let mut conn = self.conn.clone();
        ops::acquire(&mut conn, &self.scripts, key, token, ttl, Some(keep)).await
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
                key: items[i].0.key().to_owned(),
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
        crate::types::validate_ttl(ttl)?;
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

/// The subscription task: sharded subscriptions on a cluster connection of their own.
///
/// Not on the command connection: when a slot with subscribed channels moves away, its node
/// pushes an unrequested `sunsubscribe` for each, and redis-rs takes a subscription push for
/// the reply of the oldest request waiting on that node's connection; every later reply would
/// then answer the request sent before it (a grant reported to the acquire of another key,
/// a holder's "busy" to a caller whose acquire was granted). Here the only requests are
/// subscriptions.
///
/// Subscribes and unsubscribes in order, so that a late unsubscribe of a key's last waiter can
/// never undo the subscribe of its next first waiter. Started again on the current runtime when
/// the one it ran on shut down ([`Subscriptions::restarting`]); it then subscribes every
/// watched channel and wakes their waiters, since releases in the gap went unseen.
async fn subscriber(
    commands: ClusterConn,
    wakeups: Arc<Wakeups>,
    mut rx: mpsc::UnboundedReceiver<SubCmd>,
) {
    // The same builder and patience as the command connection's.
    let patience = commands.link.patience;
    let mut backoff = Duration::from_millis(20);
    let (mut conn, mut pushes) = loop {
        let (push_tx, push_rx) = mpsc::unbounded_channel::<PushInfo>();
        let connected = match (commands.link.builder)().push_sender(push_tx).build() {
            Ok(client) => client.get_async_connection().await,
            Err(e) => Err(e),
        };
        match connected {
            Ok(conn) => break (conn, push_rx),
            Err(e) => {
                debug!(error = %e, "subscription connect failed; waiters keep their timers");
                if !super::redis::drain_while_down(&mut rx, backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    };
    subscribe_all(&conn, wakeups.channels(), patience).await;
    wakeups.wake_all();
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                None => return,
                Some(SubCmd::Subscribe(channel, ack)) => {
                    subscribe(&mut conn, &channel, patience).await;
                    let _ = ack.send(());
                }
                Some(SubCmd::Unsubscribe(channel)) => {
                    let _ = conn.sunsubscribe(&channel).await;
                }
            },
            Some(push) = pushes.recv() => {
                let channel = match push.data.first() {
                    Some(Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
                    _ => None,
                };
                match (push.kind, channel) {
                    (PushKind::SMessage, Some(ch)) => wakeups.wake(&ch),
                    // A (re)subscription confirmed: after a reconnect the client resubscribes,
                    // and releases in the gap went unseen, so that channel's waiters retry.
                    (PushKind::SSubscribe, Some(ch)) if wakeups.is_watched(&ch) => {
                        wakeups.wake(&ch)
                    }
                    // One nobody waits on: its unsubscribe failed (its node was down), and the
                    // client, which forgets a channel only when a server confirms that, took it
                    // back with the node. Left alone it would stay for the connection's life.
                    (PushKind::SSubscribe, Some(ch)) => {
                        let _ = conn.sunsubscribe(&ch).await;
                    }
                    // The node dropped the subscription of a channel still waited on: its slot
                    // moved away (the client forgets such a channel and would not subscribe it
                    // again). Subscribed again, on the slot's new node, and its waiters retry.
                    // The reply to this task's own unsubscribe comes here too, for a channel no
                    // longer waited on, unless a new waiter came since: subscribing twice does
                    // no harm.
                    (PushKind::SUnsubscribe, Some(ch)) if wakeups.is_watched(&ch) => {
                        debug!(channel = ch, "subscription dropped by the node; subscribing again");
                        subscribe(&mut conn, &ch, patience).await;
                        wakeups.wake(&ch);
                    }
                    // A node connection broke, and releases may have gone unseen. Waiters are
                    // woken once every watched channel is subscribed again, not at once: the
                    // command connection to that node most likely broke at the same moment,
                    // and an attempt sent before it is made again fails, which ends its wait.
                    // Pushes already queued are covered by the wake-up; several connections
                    // that broke together cost one round.
                    (PushKind::Disconnection, _) => {
                        while pushes.try_recv().is_ok() {}
                        subscribe_all(&conn, wakeups.channels(), patience).await;
                        reach_every_master(&commands, patience).await;
                        wakeups.wake_all();
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Waits, within `patience`, until a `PING` through the command connection reaches every
/// master: a request that fails on a broken node connection is what has redis-rs make it again.
async fn reach_every_master(commands: &ClusterConn, patience: Duration) {
    use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy};
    let route = RoutingInfo::MultiNode((
        MultipleNodeRoutingInfo::AllMasters,
        Some(ResponsePolicy::AllSucceeded),
    ));
    let mut pauses = Pauses::new(patience);
    loop {
        let pinged = match commands.live().await {
            Ok(mut conn) => conn.route_command(redis::cmd("PING"), route.clone()).await,
            Err(e) => Err(e),
        };
        match pinged {
            Ok(_) => return,
            Err(e) if pauses.wait(&e).await => {}
            Err(e) => {
                debug!(error = %e, "a master stayed unreachable; waking the waiters anyway");
                return;
            }
        }
    }
}

/// Subscribes every channel of `channels` at once, each on a handle of its own to `conn` (they
/// share its node connections): a stalled master then costs the round its patience once, not
/// once for each of its channels, and the waiters of every other master are not kept waiting
/// for it one channel after another. All are subscribes, so their order does not matter.
async fn subscribe_all(conn: &ClusterConnection, channels: Vec<String>, patience: Duration) {
    let each = channels.iter().map(|channel| {
        let mut conn = conn.clone();
        async move { subscribe(&mut conn, channel, patience).await }
    });
    futures_util::future::join_all(each).await;
}

/// Subscribes `channel`. One refused unrun, or whose connection dropped or timed out, is sent
/// again after a pause, within the connection's patience: subscribing twice does no harm, so
/// unlike [`ClusterConn`]'s requests this covers a lost answer too. One that fails leaves its
/// waiters to their timers.
async fn subscribe(conn: &mut ClusterConnection, channel: &str, patience: Duration) {
    let mut pauses = Pauses::new(patience);
    loop {
        match conn.ssubscribe(channel).await {
            Err(e)
                if (unrun(&e) || e.is_connection_dropped() || e.is_timeout())
                    && pauses.wait(&e).await => {}
            Err(e) => {
                debug!(error = %e, channel, "sharded subscribe failed; the waiter keeps its timer");
                return;
            }
            Ok(()) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::error_reply as reply;

    /// "No timeout" (`Duration::MAX`, which `RedisConfig` accepts) for either timeout gives a
    /// connect no limit, not an overflow.
    #[test]
    fn a_connect_without_timeouts_has_no_limit() {
        let s = Duration::from_secs;
        assert_eq!(connect_patience(s(1), s(2)), s(4));
        assert_eq!(connect_patience(Duration::MAX, s(2)), Duration::MAX);
        assert_eq!(connect_patience(s(1), Duration::MAX), Duration::MAX);
    }

    /// The pause between connection checks the docs give: 1 s after a check that kept the
    /// connection, doubling to 30 s while checks keep finding nothing better; a new
    /// `CheckPause` (what the connection puts back once a check helped or found every master
    /// answering) starts from 1 s again. That reset itself is not driven here.
    #[test]
    fn check_pauses_double_to_thirty_seconds_and_start_over() {
        let t0 = Instant::now();
        let mut pause = CheckPause::new();
        assert!(!pause.paused(t0));
        let mut now = t0;
        let mut seen = Vec::new();
        for _ in 0..7 {
            let p = pause.kept(now);
            assert!(pause.paused(now + p - Duration::from_millis(1)));
            assert!(!pause.paused(now + p));
            seen.push(p.as_secs());
            now += p;
        }
        assert_eq!(seen, [1, 2, 4, 8, 16, 30, 30]);
        pause = CheckPause::new();
        assert!(!pause.paused(now));
        assert_eq!(pause.kept(now), Duration::from_secs(1));
    }

    /// A `CLUSTER SLOTS` entry: slots `start..=end` served by the master `host:port` (`None`:
    /// a null host) with node id `id` (`None`: an old server that sends none).
    fn range(start: i64, end: i64, host: Option<&str>, port: i64, id: Option<&str>) -> Value {
        let mut master = vec![
            host.map_or(Value::Nil, |h| Value::BulkString(h.into())),
            Value::Int(port),
        ];
        master.extend(id.map(|i| Value::BulkString(i.into())));
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(master),
        ])
    }

    fn routed(map: &SlotMap, slot: u16) -> Option<RoutingInfo> {
        map.route(map.owner[usize::from(slot)])
    }

    #[test]
    fn batches_go_by_address_or_by_a_slot_of_the_node() {
        let by_slot = |slot| {
            Some(RoutingInfo::SingleNode(
                SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)),
            ))
        };
        let map = SlotMap::parse(&Value::Array(vec![
            range(0, 99, Some("10.0.0.1"), 7000, Some("a")),
            range(100, 199, Some(""), 7000, Some("b")),
            // Two nodes advertising the same unusable address stay two nodes.
            range(200, 299, Some("?"), 7000, Some("c")),
            range(300, 399, Some("?"), 7000, Some("d")),
            range(400, 499, None, 7001, Some("e")),
            range(500, 16383, Some("10.0.0.1"), 7002, None),
            // A second range of node b: one node, routed by its first slot.
            range(16000, 16383, Some(""), 7000, Some("b")),
        ]))
        .expect("parsed");
        assert_eq!(map.nodes.len(), 6);
        assert_eq!(
            routed(&map, 50),
            Some(RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: "10.0.0.1".into(),
                port: 7000
            }))
        );
        assert_eq!(routed(&map, 150), by_slot(100));
        assert_eq!(routed(&map, 16100), by_slot(100));
        assert_eq!(routed(&map, 250), by_slot(200));
        assert_eq!(routed(&map, 350), by_slot(300));
        assert_eq!(routed(&map, 450), by_slot(400));
        assert_eq!(
            routed(&map, 600),
            Some(RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: "10.0.0.1".into(),
                port: 7002
            }))
        );
        // A reply in a shape not understood gives no map (renewal then goes slot by slot).
        assert!(SlotMap::parse(&Value::Array(vec![Value::Int(1)])).is_none());
        assert!(SlotMap::parse(&Value::Nil).is_none());
    }

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
