//! Torture harness: many clients in several OS processes take leases on a few hot keys against
//! a `redis-server` this program starts, while it injects faults (pauses, crashes, server
//! restarts, `SCRIPT FLUSH`, `CLIENT KILL`, and network latency, stalls and cuts through a TCP
//! proxy of ours; on a cluster, master kills with failover and manual failovers); afterwards it
//! checks what the grants and the fenced resource saw, prints a summary table and exits non-zero
//! if an invariant failed.
//!
//! ```text
//! cargo run --release --example torture -- --seed 7 --secs 40 --clients 4 --keys 2
//! ```
//!
//! Options (defaults in brackets): `--seed N` [1], `--secs N` [30], `--clients N` child
//! processes [4], `--tasks N` client loops per process [2], `--keys N` hot keys [2],
//! `--ttl-ms N` [300], `--faults pause,crash,restart,flush,clientkill,latency,stall,cut` [all],
//! `--persist`
//! (the lock server runs with `appendonly yes`, `appendfsync always`), `--break-resource` (a
//! self-test: the resource accepts every write, and the checker must then FAIL the run),
//! `--break-lease` (a self-test, on one server: one grant in four has its lock key deleted
//! behind its holder's back, as a server that lost it would, and the checker must then FAIL the
//! run on unexplained double grants),
//! `--events FILE` (every fault and event as JSON lines), `--deploy quorum` (three lock
//! servers and `Locker::redlock`; server faults hit one member at random; default `single`),
//! `--deploy cluster` (a Redis Cluster of three masters with one replica each and
//! `Locker::redis_cluster`; faults `pause,crash,masterkill,failover,flush,clientkill` [all of
//! them]: `masterkill` SIGKILLs the master of a hot key's shard, waits for its replica to be
//! promoted, then restarts the old master, which rejoins as a replica; `failover` is a graceful
//! `CLUSTER FAILOVER` on that shard's replica; `flush` and `clientkill` hit that shard's master),
//! `--force-failover` (promote the killed master's replica at once with `CLUSTER FAILOVER FORCE`),
//! `--lag-replica` (hold the replica back before the kill, so the kill loses acknowledged
//! writes; implies `--force-failover`), `--help`.
//!
//! Each child reaches the lock server through its own TCP proxy (`tests/support/proxy.rs`),
//! which runs in this parent process: the network faults hit one child, or all of them, by
//! driving those proxies. Not on a cluster: a cluster client connects to the node addresses the
//! slot map names, so a proxy in front of the seed nodes would carry almost nothing; the
//! children connect to the nodes directly, and the network faults are refused with
//! `--deploy cluster`.
//!
//! Two servers: the *lock server*, which takes the faults, and the *resource server*, which
//! plays the protected data store and is never faulted. The fenced resource is a script on the
//! resource server that, atomically, refuses a fence lower than the highest it stored, stores
//! it and appends it to a list: that list is the resource's own acceptance order, which the
//! checker reads back instead of trusting what the clients say. Beside it, the negative
//! control: an unfenced counter every holder reads (GET) at the start of its hold and writes
//! (SET n+1) at the end; lost increments show that the faults really broke mutual exclusion.
//!
//! Time stamps are wall-clock microseconds (`SystemTime`), compared across processes; that is
//! sound only because every process runs on this one host.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold::{LockOptions, Locker, Release};
use serde_json::{Value, json};

// The test suite's proxy, shared rather than copied; the harness uses only its network faults.
#[allow(dead_code)]
#[path = "../tests/support/proxy.rs"]
mod proxy;

use proxy::Proxy;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every fault kind, the default `--faults`.
const ALL_FAULTS: [&str; 8] = [
    "pause",
    "crash",
    "restart",
    "flush",
    "clientkill",
    "latency",
    "stall",
    "cut",
];

/// The faults that drive a child's proxy rather than the server or the process.
const NET_FAULTS: [&str; 3] = ["latency", "stall", "cut"];

/// Every fault kind of `--deploy cluster`, its default `--faults`. There is no proxy to drive
/// and no single server to restart; a master kill with failover takes the restart's place.
const CLUSTER_FAULTS: [&str; 6] = [
    "pause",
    "crash",
    "masterkill",
    "failover",
    "flush",
    "clientkill",
];

/// How the lock servers are deployed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Deploy {
    /// One server (`Locker::redis`).
    Single,
    /// Three independent servers (`Locker::redlock`).
    Quorum,
    /// Three masters with a replica each (`Locker::redis_cluster`).
    Cluster,
}

impl Deploy {
    fn name(self) -> &'static str {
        match self {
            Deploy::Single => "single",
            Deploy::Quorum => "quorum",
            Deploy::Cluster => "cluster",
        }
    }
}

/// The fenced resource. KEYS: highest accepted fence, acceptance list, refusal counter;
/// ARGV[1]: the offered fence. Fences are wall-clock microseconds (below 2^53), so Lua's
/// doubles compare them exactly; the stored values stay the caller's decimal strings.
const RESOURCE_WRITE: &str = r"
local highest = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < highest then
  redis.call('INCR', KEYS[3])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
";

/// The same resource with its fence check removed (`--break-resource`): a self-test that
/// shows the checker catches stale writes when the resource lets them through.
const BROKEN_WRITE: &str = r"
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
";

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// A tiny xorshift64* generator: the fault schedule must be repeatable from `--seed` and the
/// workspace has no `rand`.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `[lo, hi)`; `lo` when the range is empty.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next() % (hi - lo)
        }
    }
}

#[derive(Clone)]
struct Opts {
    seed: u64,
    secs: u64,
    clients: usize,
    tasks: usize,
    keys: usize,
    ttl_ms: u64,
    faults: Vec<String>,
    persist: bool,
    break_resource: bool,
    /// `--break-lease`: a client deletes the lock key of one grant in four right after it is
    /// granted, so that another holder is granted while the first still holds.
    break_lease: bool,
    /// `--force-failover`: after a master kill, promote its replica at once with
    /// `CLUSTER FAILOVER FORCE` instead of waiting for the cluster to notice.
    force_failover: bool,
    /// `--lag-replica`: before a master kill, hold the replica back (SIGSTOP, and enough
    /// ballast written on the master to fill the socket between them), so the kill loses what
    /// the master acknowledged meanwhile; implies `--force-failover`.
    lag_replica: bool,
    /// `--deploy`: one server, a Redlock quorum or a cluster.
    deploy: Deploy,
    /// Where to write every event and fault as JSON lines, for a closer look after a run.
    events_file: Option<String>,
    child: Option<(usize, usize)>,
    url: String,
    res_url: String,
    until: u64,
}

const USAGE: &str = "\
torture: lease holders in several processes against real servers, under injected faults;
checks fences, the fenced resource and double grants, prints a summary, exits 1 on a failure.

usage: cargo run --all-features --example torture -- [options]

  --seed N            fault schedule and key choice [1]
  --secs N            run time in seconds [30]
  --clients N         child processes [4]
  --tasks N           client loops per child [2]
  --keys N            hot keys [2]
  --ttl-ms N          lease TTL [300]
  --faults LIST       comma-separated fault kinds [all of the deployment's]
                        single, quorum: pause,crash,restart,flush,clientkill,latency,stall,cut
                        cluster:        pause,crash,masterkill,failover,flush,clientkill
  --deploy KIND       single (one server, Locker::redis) [default]
                      quorum (three servers, Locker::redlock; server faults hit one member)
                      cluster (3 masters with 1 replica each, Locker::redis_cluster)
  --persist           lock servers run with appendonly yes, appendfsync always
  --force-failover    cluster: after a master kill, promote its replica at once with
                      CLUSTER FAILOVER FORCE instead of waiting for automatic failover
  --lag-replica       cluster: before a master kill, SIGSTOP its replica and write 32 MB of
                      ballast on the master, so what it acknowledges in the next ttl/2 to 1
                      TTL never reaches the replica and is lost; implies --force-failover
  --break-resource    self-test: the resource accepts every write; the run must FAIL
  --break-lease       self-test (single): one grant in four has its lock key deleted behind
                      its holder's back; the run must FAIL on unexplained double grants
  --events FILE       write every fault and event as JSON lines

Faults: pause (SIGSTOP a holder's process for 2-3 TTLs), crash (SIGKILL a child, start a new
one), restart (SIGKILL the lock server, start it again), flush (SCRIPT FLUSH), clientkill
(CLIENT KILL TYPE normal), latency/stall/cut (network faults through a proxy per child).
On a cluster: masterkill (SIGKILL the master of a hot key's shard, wait until its replica is
promoted, restart the old master, which rejoins as a replica), failover (a graceful CLUSTER
FAILOVER on that shard's replica); flush and clientkill hit that shard's master. A double
grant is allowed on a cluster only when a master kill of its key's shard falls between the
two grants and the later one came within one TTL of the promotion (asynchronous replication
can lose a grant or a renewal); a graceful failover explains none.

Network faults are not available on a cluster: a cluster client connects to the node
addresses the slot map names, not to the seed addresses it was given, so a proxy in front of
the seeds would see almost none of the traffic. The children connect to the nodes directly.
";

fn parse_args() -> Result<Opts, BoxError> {
    let mut o = Opts {
        seed: 1,
        secs: 30,
        clients: 4,
        tasks: 2,
        keys: 2,
        ttl_ms: 300,
        faults: ALL_FAULTS.map(String::from).to_vec(),
        persist: false,
        break_resource: false,
        break_lease: false,
        force_failover: false,
        lag_replica: false,
        deploy: Deploy::Single,
        events_file: None,
        child: None,
        url: String::new(),
        res_url: String::new(),
        until: 0,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut faults_given = false;
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "--help" || flag == "-h" {
            print!("{USAGE}");
            std::process::exit(0);
        }
        if [
            "--persist",
            "--break-resource",
            "--break-lease",
            "--force-failover",
            "--lag-replica",
        ]
        .contains(&flag)
        {
            o.persist |= flag == "--persist";
            o.break_resource |= flag == "--break-resource";
            o.break_lease |= flag == "--break-lease";
            o.lag_replica |= flag == "--lag-replica";
            o.force_failover |= flag == "--force-failover" || o.lag_replica;
            i += 1;
            continue;
        }
        let v = args
            .get(i + 1)
            .ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: `{v}` is not a number"))
        };
        match flag {
            "--seed" => o.seed = num()?,
            "--secs" => o.secs = num()?,
            "--clients" => o.clients = num()? as usize,
            "--tasks" => o.tasks = num()? as usize,
            "--keys" => o.keys = num()? as usize,
            "--ttl-ms" => o.ttl_ms = num()?,
            "--until" => o.until = num()?,
            "--url" => o.url = v.clone(),
            "--res-url" => o.res_url = v.clone(),
            "--events" => o.events_file = Some(v.clone()),
            "--deploy" => {
                o.deploy = match v.as_str() {
                    "single" => Deploy::Single,
                    "quorum" => Deploy::Quorum,
                    "cluster" => Deploy::Cluster,
                    _ => {
                        return Err(
                            format!("--deploy: `{v}` is not single, quorum or cluster").into()
                        );
                    }
                }
            }
            "--faults" => {
                faults_given = true;
                o.faults = v
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect();
            }
            "--child" => {
                let (a, b) = v.split_once('.').ok_or("--child wants INDEX.INCARNATION")?;
                o.child = Some((a.parse()?, b.parse()?));
            }
            _ => return Err(format!("unknown option `{flag}`").into()),
        }
        i += 2;
    }
    // Checked once every option is read, since the valid kinds depend on `--deploy`.
    let kinds: &[&str] = if o.deploy == Deploy::Cluster {
        if !faults_given {
            o.faults = CLUSTER_FAULTS.map(String::from).to_vec();
        }
        &CLUSTER_FAULTS
    } else {
        &ALL_FAULTS
    };
    for f in &o.faults {
        if !kinds.contains(&f.as_str()) {
            let why = if o.deploy == Deploy::Cluster {
                if NET_FAULTS.contains(&f.as_str()) {
                    " (a cluster client connects to the nodes the slot map names, so there is \
                     no proxy for network faults)"
                } else if f == "restart" {
                    " (on a cluster, `masterkill` kills a master and lets its replica take over)"
                } else {
                    ""
                }
            } else if CLUSTER_FAULTS.contains(&f.as_str()) {
                " (only with --deploy cluster)"
            } else {
                ""
            };
            return Err(format!("fault `{f}` is not one of {}{why}", kinds.join(",")).into());
        }
    }
    if o.break_lease && o.deploy != Deploy::Single {
        return Err("--break-lease needs --deploy single".into());
    }
    if o.force_failover && o.deploy != Deploy::Cluster {
        return Err("--force-failover and --lag-replica need --deploy cluster".into());
    }
    if o.clients == 0 || o.tasks == 0 || o.keys == 0 || o.secs == 0 {
        return Err("--clients, --tasks, --keys and --secs must be at least 1".into());
    }
    Ok(o)
}

fn main() -> Result<(), BoxError> {
    let opts = parse_args()?;
    if let Some((index, incarnation)) = opts.child {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        return rt.block_on(child_main(opts, index, incarnation));
    }
    let ok = parent_main(&opts)?;
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Child: client loops.

fn emit(v: Value) {
    println!("{v}");
}

async fn child_main(opts: Opts, index: usize, incarnation: usize) -> Result<(), BoxError> {
    // The lock server may be down (a restart in progress) when a replacement child starts.
    let locker = loop {
        let urls: Vec<&str> = opts.url.split(',').collect();
        let connected = match opts.deploy {
            Deploy::Single => Locker::redis(&opts.url).await,
            Deploy::Quorum => Locker::redlock(&urls).await,
            Deploy::Cluster => Locker::redis_cluster(&urls).await,
        };
        match connected {
            Ok(l) => break l,
            Err(_) if now_us() < opts.until => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => return Err(e.into()),
        }
    };
    let res = redis::Client::open(opts.res_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    // `--break-lease`: a connection of its own to the lock server, to delete lock keys on.
    let breaker = if opts.break_lease {
        Some(
            redis::Client::open(opts.url.as_str())?
                .get_multiplexed_async_connection()
                .await?,
        )
    } else {
        None
    };
    let mut tasks = Vec::new();
    for t in 0..opts.tasks {
        let (locker, res, o) = (locker.clone(), res.clone(), opts.clone());
        let breaker = breaker.clone();
        let id = format!("{index}.{incarnation}.{t}");
        let seed = opts.seed ^ ((index as u64) << 32) ^ ((incarnation as u64) << 16) ^ t as u64;
        tasks.push(tokio::spawn(client(locker, res, breaker, o, id, seed)));
    }
    // The lag probe: a timer that should wake every 5 ms. When it wakes much later, this
    // process was not running (a loaded machine), which is what a late `lost()` of a holder
    // nobody paused is checked against.
    let c = format!("{index}.{incarnation}");
    let probe = tokio::spawn(async move {
        loop {
            let t = now_us();
            tokio::time::sleep(Duration::from_millis(5)).await;
            let lag = now_us().saturating_sub(t + 5_000);
            if lag > 10_000 {
                emit(json!({"ev": "lag", "c": c, "t0": t, "t": now_us(), "lag_us": lag}));
            }
        }
    });
    for task in tasks {
        task.await?;
    }
    probe.abort();
    let _ = probe.await;
    drop(locker);
    drop(res);
    drop(breaker);
    // Whatever is still alive now (renewal driver, watchers, release tasks) is work left
    // running after every lease was released and the locker dropped.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let alive = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    emit(
        json!({"ev": "exit", "c": format!("{index}.{incarnation}"), "alive_tasks": alive, "t": now_us()}),
    );
    Ok(())
}

async fn client(
    locker: Locker,
    mut res: redis::aio::MultiplexedConnection,
    mut breaker: Option<redis::aio::MultiplexedConnection>,
    o: Opts,
    id: String,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    let script = redis::Script::new(if o.break_resource {
        BROKEN_WRITE
    } else {
        RESOURCE_WRITE
    });
    let ttl = Duration::from_millis(o.ttl_ms);
    let opts = LockOptions::new()
        .ttl(ttl)
        .wait(Duration::from_secs(3))
        .renew(true);
    while now_us() < o.until {
        let key = format!("hot:{}", rng.range(0, o.keys as u64));
        let t_req = now_us();
        let lease = match locker.acquire(&key, &opts).await {
            Ok(l) => l,
            Err(e) => {
                emit(
                    json!({"ev": "acq_err", "c": id, "key": key, "err": e.to_string(), "t": now_us()}),
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let t_start = now_us();
        let fence = lease.fence().0;
        emit(json!({"ev": "grant", "c": id, "key": key, "fence": fence,
            "token": &lease.token().as_str()[..8.min(lease.token().as_str().len())],
            "t_req": t_req, "t": t_start}));

        // The lost watcher: samples the local deadline while the lease is held so that, when
        // `lost` fires, it can say whether the holder was told before that deadline.
        let released = Arc::new(AtomicBool::new(false));
        let info = lease.info();
        // The last local deadline seen, shared with the end event: a later grant after it is
        // a lapsed lease, not a violation.
        let last_deadline = Arc::new(AtomicU64::new(
            now_us() + info.remaining().as_micros() as u64,
        ));
        let (wid, wkey, wreleased, wdeadline) = (
            id.clone(),
            key.clone(),
            released.clone(),
            last_deadline.clone(),
        );
        tokio::spawn(async move {
            let mut deadline = wdeadline.load(Ordering::SeqCst);
            loop {
                tokio::select! {
                    _ = info.lost() => break,
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {
                        if !info.is_lost() {
                            deadline = now_us() + info.remaining().as_micros() as u64;
                            wdeadline.store(deadline, Ordering::SeqCst);
                        }
                    }
                }
            }
            // `lost` also resolves on release; only a loss while still holding counts.
            if !wreleased.load(Ordering::SeqCst) {
                let t = now_us();
                emit(
                    json!({"ev": "lost", "c": wid, "key": wkey, "fence": fence, "t": t,
                    "deadline": deadline}),
                );
            }
        });

        // `--break-lease`: the key deleted behind this holder's back, which the server never
        // does on its own (no fault here explains the next holder's grant).
        if let Some(conn) = breaker.as_mut()
            && rng.range(0, 4) == 0
            && let Ok(k) = locker.lock_key(&key)
        {
            let _: Result<i64, _> = redis::cmd("DEL").arg(k.lock_key()).query_async(conn).await;
        }

        // Negative control, part 1: read the unfenced counter.
        let counter = format!("cnt:{key}");
        let read: Result<Option<i64>, _> =
            redis::cmd("GET").arg(&counter).query_async(&mut res).await;
        // Most holds are short; one in five lasts half the TTL to three TTLs, so the lease must
        // be renewed while held and a network fault can make it lapse under its holder.
        let long = rng.range(0, 5) == 0;
        let hold = if long {
            rng.range(o.ttl_ms / 2, 3 * o.ttl_ms + 1)
        } else {
            rng.range(10, 60)
        };
        if long && rng.range(0, 2) == 0 {
            // Half the long holds also extend explicitly, midway, beside the renewal driver's
            // own renewals, to a TTL from half the lease's to all of it: a shorter one must
            // shorten the local deadline, and no answer may let that deadline pass the
            // server's expiry (the double-grant check below would see a later grant while
            // this holder still thought it held). Not longer than the lease's TTL: the checker
            // explains overlaps after a failover by a lease lasting at most one TTL.
            tokio::time::sleep(Duration::from_millis(hold / 2)).await;
            let to = rng.range((o.ttl_ms / 2).max(10), o.ttl_ms + 1);
            let extended = lease.extend(Duration::from_millis(to)).await;
            emit(
                json!({"ev": "extend", "c": id, "key": key, "fence": fence, "ttl_ms": to,
                "ok": extended.is_ok(),
                "lost": matches!(extended, Err(leasehold::Error::LeaseLost { .. })),
                "t": now_us()}),
            );
            tokio::time::sleep(Duration::from_millis(hold - hold / 2)).await;
        } else {
            tokio::time::sleep(Duration::from_millis(hold)).await;
        }
        // The fenced write. Deliberately made whether or not the lease is still held: the
        // fence, not the holder's own check, is what must stop a stale writer.
        let was_lost = lease.is_lost();
        let verdict: Result<i64, _> = script
            .key(format!("res:{key}:highest"))
            .key(format!("res:{key}:accepted"))
            .key(format!("res:{key}:refused"))
            .arg(fence.to_string())
            .invoke_async(&mut res)
            .await;
        match verdict {
            Ok(v) => emit(json!({"ev": "write", "c": id, "key": key, "fence": fence,
                "ok": v == 1, "lost": was_lost, "t": now_us()})),
            Err(e) => emit(json!({"ev": "write_err", "c": id, "key": key, "err": e.to_string()})),
        }
        // Negative control, part 2: write back n+1 without any fence.
        if let Ok(n) = read {
            let n = n.unwrap_or(0);
            let set: Result<(), _> = redis::cmd("SET")
                .arg(&counter)
                .arg(n + 1)
                .query_async(&mut res)
                .await;
            if set.is_ok() {
                emit(json!({"ev": "inc", "c": id, "key": key, "from": n}));
            }
        }
        let t_rel = now_us();
        released.store(true, Ordering::SeqCst);
        let was_lost = lease.is_lost();
        let result = match lease.release().await {
            Ok(Release::Released) => "released".to_string(),
            Ok(Release::NotHeld) => "not_held".to_string(),
            Err(e) => format!("error: {e}"),
        };
        emit(
            json!({"ev": "end", "c": id, "key": key, "fence": fence, "t": t_rel,
            "t_done": now_us(), "result": result, "was_lost": was_lost,
            "deadline": last_deadline.load(Ordering::SeqCst)}),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Parent: servers, children, faults, checks.

/// A `redis-server` on a fixed loopback port; restartable on the same port.
struct Server {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    persist: bool,
    /// Extra configuration arguments (a cluster node's).
    extra: Vec<String>,
}

impl Server {
    fn start(persist: bool) -> Result<Server, BoxError> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        Server::start_on(port, persist, Vec::new())
    }

    fn start_on(port: u16, persist: bool, extra: Vec<String>) -> Result<Server, BoxError> {
        let mut s = Server {
            child: None,
            port,
            dir: tempfile::tempdir()?,
            persist,
            extra,
        };
        s.spawn()?;
        Ok(s)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn spawn(&mut self) -> Result<(), BoxError> {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", ""])
            .arg("--dir")
            .arg(self.dir.path());
        if self.persist {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        cmd.args(&self.extra);
        let child = cmd
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start redis-server (is it installed?): {e}"))?;
        self.child = Some(child);
        let client = redis::Client::open(self.url())?;
        for _ in 0..250 {
            if let Ok(mut c) = client.get_connection()
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err("redis-server did not answer PING".into())
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn conn(&self) -> Result<redis::Connection, BoxError> {
        Ok(redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(2))?)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Number of masters of `--deploy cluster`; each has one replica.
const CLUSTER_MASTERS: usize = 3;

/// A node as one line of `CLUSTER NODES` describes it, as far as the faults need.
struct NodeLine {
    id: String,
    port: u16,
    flags: Vec<String>,
    /// The master's id, for a replica.
    master: Option<String>,
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    fn parse(line: &str) -> Option<NodeLine> {
        let f: Vec<&str> = line.split_whitespace().collect();
        // `ip:port@busport[,hostname]`
        let port = f
            .get(1)?
            .split('@')
            .next()?
            .rsplit(':')
            .next()?
            .parse()
            .ok()?;
        let slots = f
            .get(8..)
            .unwrap_or_default()
            .iter()
            // `[slot->-id]` entries are slots being moved; the harness never moves any.
            .filter(|r| !r.starts_with('['))
            .filter_map(|r| match r.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => r.parse().ok().map(|n| (n, n)),
            })
            .collect();
        Some(NodeLine {
            id: f.first()?.to_string(),
            port,
            flags: f.get(2)?.split(',').map(String::from).collect(),
            master: f.get(3).filter(|m| **m != "-").map(|m| m.to_string()),
            slots,
        })
    }

    fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
}

/// A cluster made as the test suite makes one (`tests/support/mod.rs`): `redis-cli --cluster
/// create` over fresh nodes, `cluster-node-timeout 1000`, so an automatic failover takes a few
/// seconds. Its nodes are the harness's lock servers; this adds what the faults need to find
/// their way around it.
struct Cluster {
    /// The slot of each hot key's lock (`hot:0`, `hot:1`, ...).
    key_slots: Vec<u16>,
    /// The hash tag of each hot key's server keys, `{prefix:key}`, to put ballast in its slot.
    key_tags: Vec<String>,
}

/// A free loopback port whose cluster-bus twin (port + 10000) is free too.
fn free_cluster_port() -> Result<u16, BoxError> {
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        if port < 55_535 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return Ok(port);
        }
    }
    Err("no free loopback port pair for a cluster node".into())
}

impl Cluster {
    /// Starts the nodes, creates the cluster and waits until it is healthy with every replica
    /// in sync (a replica still syncing cannot be promoted).
    fn start(persist: bool, keys: usize) -> Result<(Cluster, Vec<Server>), BoxError> {
        let mut nodes = Vec::new();
        for _ in 0..CLUSTER_MASTERS * 2 {
            let extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--repl-diskless-sync-delay",
                "0",
                // The other shards keep serving while one fails over, as in
                // tests/cluster_faults.rs; with the default (`yes`) every lease on every
                // shard would be lost at each master kill, which tests nothing more.
                "--cluster-require-full-coverage",
                "no",
            ]
            .map(String::from)
            .to_vec();
            nodes.push(Server::start_on(free_cluster_port()?, persist, extra)?);
        }
        let mut create = Command::new("redis-cli");
        create.args(["--cluster", "create"]);
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .map_err(|e| format!("cannot run redis-cli (is it installed?): {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            )
            .into());
        }
        // The lock key of each hot key, as the clients name it.
        let namer = Locker::memory();
        let (mut key_slots, mut key_tags) = (Vec::new(), Vec::new());
        for k in 0..keys {
            let key = namer.lock_key(&format!("hot:{k}"))?;
            let tag_end = key
                .lock_key()
                .find('}')
                .ok_or("a lock key without a hash tag")?;
            key_tags.push(key.lock_key()[..=tag_end].to_string());
            let slot: u16 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(key.lock_key())
                .query(&mut nodes[0].conn()?)?;
            key_slots.push(slot);
        }
        let cluster = Cluster {
            key_slots,
            key_tags,
        };
        cluster.wait_stable(&nodes, Duration::from_secs(30))?;
        Ok((cluster, nodes))
    }

    /// The cluster as the first running node that answers sees it.
    fn view(nodes: &[Server]) -> Result<Vec<NodeLine>, BoxError> {
        for n in nodes.iter().filter(|n| n.child.is_some()) {
            let Ok(mut c) = n.conn() else { continue };
            if let Ok(text) = redis::cmd("CLUSTER").arg("NODES").query::<String>(&mut c) {
                return Ok(text.lines().filter_map(NodeLine::parse).collect());
            }
        }
        Err("no cluster node answered CLUSTER NODES".into())
    }

    /// Healthy, as every running node sees it: all slots served, no node flagged failing,
    /// and every master with a replica whose link is up.
    fn stable(nodes: &[Server]) -> bool {
        let mut synced = 0;
        for n in nodes.iter().filter(|n| n.child.is_some()) {
            let Ok(mut c) = n.conn() else { return false };
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut c)
                .unwrap_or_default();
            if !info.contains("cluster_state:ok") || !info.contains("cluster_slots_ok:16384") {
                return false;
            }
            let view: String = redis::cmd("CLUSTER")
                .arg("NODES")
                .query(&mut c)
                .unwrap_or_default();
            // `fail` and `fail?` alike: a later kill must not meet a node still suspected.
            if view.is_empty() || view.contains("fail") {
                return false;
            }
            // Every replica known as one, with its master, to this node too: right after
            // `--cluster create` the gossip can lag behind the replicas' own links.
            let replicas = view
                .lines()
                .filter_map(NodeLine::parse)
                .filter(|l| l.has("slave") && l.master.is_some())
                .count();
            if replicas != CLUSTER_MASTERS {
                return false;
            }
            let repl: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut c)
                .unwrap_or_default();
            synced +=
                (repl.contains("role:slave") && repl.contains("master_link_status:up")) as usize;
        }
        synced == CLUSTER_MASTERS
    }

    fn wait_stable(&self, nodes: &[Server], within: Duration) -> Result<(), BoxError> {
        let start = std::time::Instant::now();
        while !Cluster::stable(nodes) {
            if start.elapsed() > within {
                return Err(format!("the cluster was not healthy again within {within:?}").into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// The master serving `slot` and its replica, as indices into `nodes`, once the view the
    /// harness reads agrees with what the two nodes say of themselves (right after a failover
    /// a node's view can lag behind the promotion).
    fn shard_of(&self, nodes: &[Server], slot: u16) -> Result<(usize, usize), BoxError> {
        let start = std::time::Instant::now();
        loop {
            let found = Cluster::shard_in_view(nodes, slot).and_then(|(m, r)| {
                if nodes[m].child.is_some() && is_master(&nodes[m]) && !is_master(&nodes[r]) {
                    Ok((m, r))
                } else {
                    Err(format!(
                        "slot {slot}: CLUSTER NODES names port {} as master and {} as its \
                         replica, and the nodes disagree",
                        nodes[m].port, nodes[r].port
                    )
                    .into())
                }
            });
            match found {
                Ok(shard) => return Ok(shard),
                Err(e) if start.elapsed() > Duration::from_secs(10) => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    fn shard_in_view(nodes: &[Server], slot: u16) -> Result<(usize, usize), BoxError> {
        let view = Cluster::view(nodes)?;
        let index = |port: u16| nodes.iter().position(|n| n.port == port);
        let master = view
            .iter()
            .find(|l| l.has("master") && l.slots.iter().any(|&(a, b)| a <= slot && slot <= b))
            .ok_or_else(|| format!("no master serves slot {slot}"))?;
        let replica = view
            .iter()
            .find(|l| l.master.as_deref() == Some(master.id.as_str()))
            .ok_or_else(|| format!("the master of slot {slot} has no replica"))?;
        match (index(master.port), index(replica.port)) {
            (Some(m), Some(r)) => Ok((m, r)),
            _ => Err("CLUSTER NODES names a port the harness did not start".into()),
        }
    }

    /// The hot keys whose lock lives on the shard of `master` (an index into `nodes`).
    fn keys_on(&self, nodes: &[Server], master: usize) -> Result<Vec<String>, BoxError> {
        let mut keys = Vec::new();
        for (k, &slot) in self.key_slots.iter().enumerate() {
            if self.shard_of(nodes, slot)?.0 == master {
                keys.push(format!("hot:{k}"));
            }
        }
        Ok(keys)
    }
}

/// Whether a node reports itself a master (`INFO replication`).
fn is_master(node: &Server) -> bool {
    node.conn()
        .ok()
        .and_then(|mut c| {
            redis::cmd("INFO")
                .arg("replication")
                .query::<String>(&mut c)
                .ok()
        })
        .is_some_and(|info| info.contains("role:master"))
}

/// One injected fault, for the summary and for explaining double grants.
struct Fault {
    kind: &'static str,
    /// The child index it hit, for pauses, crashes and network faults on one child; a network
    /// fault with `None` hit every child.
    child: Option<usize>,
    /// Whether it was aimed at a child that held a lease (pauses and network faults).
    on_holder: bool,
    /// The one-way delay of a latency fault, in ms.
    latency_ms: u64,
    /// The hot keys on the shard a cluster fault hit.
    keys: Vec<String>,
    /// When the master was killed, or the FAILOVER command sent; with `--lag-replica`, `t0`
    /// is earlier, when the replica was held back.
    t_kill: u64,
    /// When the replica took over, for a master kill or a manual failover.
    t_promoted: u64,
    t0: u64,
    t1: u64,
}

impl Fault {
    fn new(kind: &'static str, child: Option<usize>, t0: u64) -> Fault {
        Fault {
            kind,
            child,
            on_holder: false,
            latency_ms: 0,
            keys: Vec::new(),
            t_kill: 0,
            t_promoted: 0,
            t0,
            t1: now_us(),
        }
    }

    /// Whether this is a network fault that reached `child` at some time in `[from, to]`.
    fn net_on(&self, child: usize, from: u64, to: u64) -> bool {
        NET_FAULTS.contains(&self.kind)
            && self.child.is_none_or(|c| c == child)
            && self.t0 <= to
            && self.t1 >= from
    }
}

type Events = Arc<Mutex<Vec<Value>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn spawn_child(
    opts: &Opts,
    index: usize,
    incarnation: usize,
    url: &str,
    res_url: &str,
    until: u64,
    events: &Events,
) -> Result<Child, BoxError> {
    let mut cmd = Command::new(std::env::current_exe()?);
    if opts.break_resource {
        cmd.arg("--break-resource");
    }
    if opts.break_lease {
        cmd.arg("--break-lease");
    }
    let mut child = cmd
        .args(["--child", &format!("{index}.{incarnation}")])
        .args(["--url", url, "--res-url", res_url])
        .args(["--until", &until.to_string()])
        .args(["--seed", &opts.seed.to_string()])
        .args(["--tasks", &opts.tasks.to_string()])
        .args(["--keys", &opts.keys.to_string()])
        .args(["--ttl-ms", &opts.ttl_ms.to_string()])
        .args(["--deploy", opts.deploy.name()])
        .stdout(Stdio::piped())
        .spawn()?;
    let out = child.stdout.take().ok_or("child has no stdout")?;
    let events = events.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            // A child killed mid-line leaves a torn last line; it is counted, not trusted.
            let v = serde_json::from_str::<Value>(&line).unwrap_or_else(|_| json!({"ev": "torn"}));
            lock(&events).push(v);
        }
    });
    Ok(child)
}

fn signal(pid: u32, sig: &str) -> Result<(), BoxError> {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()?;
    if !status.success() {
        return Err(format!("kill -{sig} {pid} failed").into());
    }
    Ok(())
}

/// A process stopped with SIGSTOP, continued when this is dropped: an error on the way must not
/// leave a server stopped for the rest of the run.
struct Stopped(Option<u32>);

impl Stopped {
    fn stop(pid: u32) -> Result<Stopped, BoxError> {
        signal(pid, "STOP")?;
        Ok(Stopped(Some(pid)))
    }

    /// Continues the process now, reporting a failure.
    fn resume(mut self) -> Result<(), BoxError> {
        self.0.take().map_or(Ok(()), |pid| signal(pid, "CONT"))
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            let _ = signal(pid, "CONT");
        }
    }
}

/// Child indices that hold a lease right now, judged from the events so far.
fn holding_children(events: &Events) -> Vec<usize> {
    let mut open: HashMap<(String, u64), usize> = HashMap::new();
    for e in lock(events).iter() {
        let (Some(c), Some(f)) = (e["c"].as_str(), e["fence"].as_u64()) else {
            continue;
        };
        match e["ev"].as_str() {
            Some("grant") => {
                let idx = c
                    .split('.')
                    .next()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                open.insert((c.to_string(), f), idx);
            }
            Some("end") => {
                open.remove(&(c.to_string(), f));
            }
            _ => {}
        }
    }
    let mut v: Vec<usize> = open.into_values().collect();
    v.sort();
    v.dedup();
    v
}

fn parent_main(opts: &Opts) -> Result<bool, BoxError> {
    // One lock server, the members of a Redlock quorum, or the nodes of a cluster.
    let (cluster, mut lock_servers) = match opts.deploy {
        Deploy::Cluster => {
            let (c, nodes) = Cluster::start(opts.persist, opts.keys)?;
            (Some(c), nodes)
        }
        _ => {
            let members = if opts.deploy == Deploy::Quorum { 3 } else { 1 };
            let servers = (0..members)
                .map(|_| Server::start(opts.persist))
                .collect::<Result<Vec<Server>, BoxError>>()?;
            (None, servers)
        }
    };
    let members = lock_servers.len();
    let res_server = Server::start(false)?;
    let res_url = res_server.url();
    // The proxies run on this runtime's threads while the fault loop below sleeps and signals.
    let net = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // One proxy per child slot and lock server, kept across a crashed child's replacements,
    // so a network fault can hit one client alone. None on a cluster (see the module docs).
    let proxies: Vec<Vec<Proxy>> = (0..opts.clients)
        .map(|_| {
            if cluster.is_some() {
                return Vec::new();
            }
            lock_servers
                .iter()
                .map(|s| net.block_on(Proxy::start(s.port)))
                .collect()
        })
        .collect();
    let node_urls = lock_servers
        .iter()
        .map(Server::url)
        .collect::<Vec<_>>()
        .join(",");
    let url_of = |i: usize| -> String {
        if cluster.is_some() {
            return node_urls.clone();
        }
        proxies[i]
            .iter()
            .map(Proxy::url)
            .collect::<Vec<_>>()
            .join(",")
    };
    let start = now_us();
    let until = start + opts.secs * 1_000_000;
    let events: Events = Arc::new(Mutex::new(Vec::new()));
    let mut children: Vec<(Child, usize)> = Vec::new();
    for i in 0..opts.clients {
        children.push((
            spawn_child(opts, i, 0, &url_of(i), &res_url, until, &events)?,
            0,
        ));
    }
    println!(
        "torture: seed {} secs {} clients {}x{} tasks keys {} ttl {} ms faults {} persist {}{}",
        opts.seed,
        opts.secs,
        opts.clients,
        opts.tasks,
        opts.keys,
        opts.ttl_ms,
        opts.faults.join(","),
        opts.persist,
        match opts.deploy {
            Deploy::Single => String::new(),
            d => format!(" deploy {}", d.name()),
        }
    );
    if let Some(c) = &cluster {
        if opts.lag_replica {
            println!(
                "cluster: before a master kill its replica is held back (SIGSTOP, 32 MB of \
                 ballast); after it, CLUSTER FAILOVER FORCE at once"
            );
        } else if opts.force_failover {
            println!("cluster: a master kill is followed at once by CLUSTER FAILOVER FORCE");
        }
        let mut shards = Vec::new();
        for slot in &c.key_slots {
            shards.push(c.shard_of(&lock_servers, *slot)?.0);
        }
        println!(
            "cluster: {} masters with a replica each; hot key slots {:?} on master nodes {:?}",
            CLUSTER_MASTERS, c.key_slots, shards
        );
    }

    let mut rng = Rng::new(opts.seed);
    let mut faults: Vec<Fault> = Vec::new();
    let ttl = opts.ttl_ms;
    // The second share of two in six: network faults, or on a cluster (no network faults)
    // the failovers, so that a 30 s run sees some.
    let net_kinds: Vec<&str> = opts
        .faults
        .iter()
        .map(String::as_str)
        .filter(|f| {
            if cluster.is_some() {
                *f == "masterkill" || *f == "failover"
            } else {
                NET_FAULTS.contains(f)
            }
        })
        .collect();
    // Leave the last two seconds fault-free so every child can finish its cycle cleanly; a
    // fault that lasts a while is cut short 1.5 s before the end for the same reason.
    let fault_end = until - 1_500_000;
    // The server faults hit one quorum member at random; with one server, no draw is taken,
    // so the schedule of a seed stays what it was before quorums.
    let member = |rng: &mut Rng| {
        if members > 1 {
            rng.range(0, members as u64) as usize
        } else {
            0
        }
    };
    // On a cluster, the server faults hit the master of a hot key's shard, drawn at random:
    // a shard that holds no hot key would exercise nothing. Returns the node and the hot keys
    // on its shard.
    let target = |rng: &mut Rng, servers: &[Server]| -> Result<(usize, Vec<String>), BoxError> {
        match &cluster {
            Some(c) => {
                let k = rng.range(0, c.key_slots.len() as u64) as usize;
                let m = c.shard_of(servers, c.key_slots[k])?.0;
                Ok((m, c.keys_on(servers, m)?))
            }
            None => Ok((member(rng), Vec::new())),
        }
    };
    let for_ms = |wanted: u64| wanted.min(fault_end.saturating_sub(now_us()) / 1000);
    while !opts.faults.is_empty() && now_us() + 2_000_000 < until {
        std::thread::sleep(Duration::from_millis(rng.range(700, 1_800)));
        if now_us() + 2_000_000 >= until {
            break;
        }
        // Pauses are what the fence is for, so they get two faults in six when enabled; the
        // network faults, the other way a holder can lapse without being stopped, get two in
        // six between them (on a cluster, the failovers take that share); the rest share what
        // is left with them.
        let pause_on = opts.faults.iter().any(|f| f == "pause");
        let pick = rng.range(0, 6);
        let kind = if pause_on && pick < 2 {
            "pause"
        } else if !net_kinds.is_empty() && (2..4).contains(&pick) {
            net_kinds[rng.range(0, net_kinds.len() as u64) as usize]
        } else {
            opts.faults[rng.range(0, opts.faults.len() as u64) as usize].as_str()
        };
        let t0 = now_us();
        // Pauses and network faults prefer a child that holds a lease: hitting an idle one
        // exercises nothing.
        let holding = holding_children(&events);
        let aim = |rng: &mut Rng| {
            if holding.is_empty() {
                (rng.range(0, children.len() as u64) as usize, false)
            } else {
                (holding[rng.range(0, holding.len() as u64) as usize], true)
            }
        };
        match kind {
            "pause" => {
                let (i, on_holder) = aim(&mut rng);
                let pid = children[i].0.id();
                signal(pid, "STOP")?;
                std::thread::sleep(Duration::from_millis(rng.range(2 * ttl, 3 * ttl + 1)));
                signal(pid, "CONT")?;
                let mut f = Fault::new("pause", Some(i), t0);
                f.on_holder = on_holder;
                faults.push(f);
            }
            "latency" | "stall" | "cut" => {
                // One child in three of four faults (a client's own link), else every child.
                let (target, on_holder) = if rng.range(0, 4) == 0 {
                    (None, !holding.is_empty())
                } else {
                    let (i, h) = aim(&mut rng);
                    (Some(i), h)
                };
                let hit: Vec<&Proxy> = match target {
                    Some(i) => proxies[i].iter().collect(),
                    None => proxies.iter().flatten().collect(),
                };
                // Latency: 20-150 ms each way, so a round trip (40-300 ms) is often above
                // ttl/3 and renewals race their deadline. Stall: ttl/2 to 4x the TTL, so the
                // held lease sometimes lapses. Cut: ttl/2 to 3x the TTL.
                let mut latency_ms = 0;
                let (kind, ms) = match kind {
                    "latency" => {
                        latency_ms = rng.range(20, 151);
                        for p in &hit {
                            p.set_latency(Duration::from_millis(latency_ms));
                        }
                        ("latency", for_ms(rng.range(1_000, 2_501)))
                    }
                    "stall" => {
                        for p in &hit {
                            p.stall(true);
                        }
                        ("stall", for_ms(rng.range(ttl / 2, 4 * ttl + 1)))
                    }
                    _ => {
                        for p in &hit {
                            p.cut(true);
                        }
                        ("cut", for_ms(rng.range(ttl / 2, 3 * ttl + 1)))
                    }
                };
                std::thread::sleep(Duration::from_millis(ms));
                for p in &hit {
                    p.set_latency(Duration::ZERO);
                    p.stall(false);
                    p.cut(false);
                }
                let mut f = Fault::new(kind, target, t0);
                f.on_holder = on_holder;
                f.latency_ms = latency_ms;
                faults.push(f);
            }
            "crash" => {
                let i = rng.range(0, children.len() as u64) as usize;
                let _ = children[i].0.kill();
                let _ = children[i].0.wait();
                let t1 = now_us();
                let inc = children[i].1 + 1;
                children[i] = (
                    spawn_child(opts, i, inc, &url_of(i), &res_url, until, &events)?,
                    inc,
                );
                let mut f = Fault::new("crash", Some(i), t0);
                f.t1 = t1;
                faults.push(f);
            }
            "restart" => {
                let m = member(&mut rng);
                lock_servers[m].kill();
                lock_servers[m].spawn()?;
                faults.push(Fault::new("restart", None, t0));
            }
            "masterkill" | "failover" => {
                let Some(c) = &cluster else {
                    return Err(format!("`{kind}` needs --deploy cluster").into());
                };
                let k = rng.range(0, c.key_slots.len() as u64) as usize;
                let (m, r) = c.shard_of(&lock_servers, c.key_slots[k])?;
                let keys = c.keys_on(&lock_servers, m)?;
                let t_fault = now_us();
                let mut stopped = None;
                if kind == "masterkill" && opts.lag_replica {
                    // A stopped replica reads nothing; once the ballast fills the socket, the
                    // master keeps the rest of the stream, the grants and renewals it
                    // acknowledges from then on included, in its own memory, which the kill
                    // throws away. Shorter than `cluster-node-timeout` in all, so the replica
                    // is not itself flagged as failing.
                    let pid = lock_servers[r]
                        .child
                        .as_ref()
                        .map(Child::id)
                        .ok_or("the replica is not running")?;
                    stopped = Some(Stopped::stop(pid)?);
                    let ballast = "x".repeat(1 << 20);
                    let mut mc = lock_servers[m].conn()?;
                    for _ in 0..32 {
                        let _: () = redis::cmd("SET")
                            .arg(format!("{}:ballast", c.key_tags[k]))
                            .arg(&ballast)
                            .query(&mut mc)?;
                    }
                    std::thread::sleep(Duration::from_millis(rng.range(ttl / 2, ttl + 1)));
                }
                let t0 = now_us();
                if kind == "masterkill" {
                    // SIGKILL: whatever the replica had not received yet is lost with it.
                    lock_servers[m].kill();
                    if let Some(s) = stopped.take() {
                        s.resume()?;
                    }
                    if opts.force_failover {
                        // Without it the replica takes over only once the others agree the
                        // master failed (2-3 s), when every lease on the shard has long run
                        // out; forced, it can take over while they are still valid.
                        let _: () = redis::cmd("CLUSTER")
                            .arg("FAILOVER")
                            .arg("FORCE")
                            .query(&mut lock_servers[r].conn()?)?;
                    }
                } else {
                    // Graceful: the master stops its clients until the replica has caught up
                    // with everything it acknowledged, then the replica takes over.
                    let _: () = redis::cmd("CLUSTER")
                        .arg("FAILOVER")
                        .query(&mut lock_servers[r].conn()?)?;
                }
                // Automatic failover (unless forced), as tests/cluster_faults.rs relies on:
                // with `cluster-node-timeout 1000` it took 2-3 s there.
                let give_up = now_us() + 20_000_000;
                while !is_master(&lock_servers[r]) {
                    if now_us() > give_up {
                        return Err(format!(
                            "{kind}: the replica on port {} was not promoted within 20 s",
                            lock_servers[r].port
                        )
                        .into());
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let t_promoted = now_us();
                if kind == "masterkill" {
                    // Same port and directory: its nodes.conf brings it back into the cluster,
                    // which turns it into a replica of the promoted node.
                    lock_servers[m].spawn()?;
                }
                c.wait_stable(&lock_servers, Duration::from_secs(30))?;
                let name = if kind == "masterkill" {
                    "master kill"
                } else {
                    "manual failover"
                };
                let mut f = Fault::new(name, None, t_fault);
                f.keys = keys;
                f.t_kill = t0;
                f.t_promoted = t_promoted;
                faults.push(f);
            }
            "flush" => {
                let (m, keys) = target(&mut rng, &lock_servers)?;
                let _: () = redis::cmd("SCRIPT")
                    .arg("FLUSH")
                    .query(&mut lock_servers[m].conn()?)?;
                let mut f = Fault::new("script flush", None, t0);
                f.keys = keys;
                faults.push(f);
            }
            _ => {
                let (m, keys) = target(&mut rng, &lock_servers)?;
                let _: i64 = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .query(&mut lock_servers[m].conn()?)?;
                let mut f = Fault::new("client kill", None, t0);
                f.keys = keys;
                faults.push(f);
            }
        }
    }

    // Children stop on their own at `until`; one still running well after is hung.
    let mut hung = 0;
    for (child, _) in &mut children {
        let deadline = until + 15_000_000;
        loop {
            if child.try_wait()?.is_some() {
                break;
            }
            if now_us() > deadline {
                hung += 1;
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // Let the reader threads drain the last lines, and every possible lease run out.
    std::thread::sleep(Duration::from_millis(ttl + 500));
    let mut leftover: Vec<String> = Vec::new();
    // On a cluster, the masters only: a replica holds copies of the same keys.
    for s in lock_servers
        .iter()
        .filter(|s| cluster.is_none() || is_master(s))
    {
        let keys: Vec<String> = redis::cmd("KEYS").arg("*:lock").query(&mut s.conn()?)?;
        leftover.extend(keys);
    }
    let mut rc = res_server.conn()?;
    let mut resource = BTreeMap::new();
    for k in 0..opts.keys {
        let key = format!("hot:{k}");
        let list: Vec<u64> = redis::cmd("LRANGE")
            .arg(format!("res:{key}:accepted"))
            .arg(0)
            .arg(-1)
            .query(&mut rc)?;
        let refused: Option<u64> = redis::cmd("GET")
            .arg(format!("res:{key}:refused"))
            .query(&mut rc)?;
        let counter: Option<u64> = redis::cmd("GET").arg(format!("cnt:{key}")).query(&mut rc)?;
        resource.insert(key, (list, refused.unwrap_or(0), counter.unwrap_or(0)));
    }
    let events = std::mem::take(&mut *lock(&events));
    if let Some(path) = &opts.events_file {
        let mut out = String::new();
        for f in &faults {
            let mut v = json!({"ev": "fault", "kind": f.kind, "child": f.child,
                "on_holder": f.on_holder, "latency_ms": f.latency_ms, "t0": f.t0, "t1": f.t1});
            if cluster.is_some() {
                v["keys"] = json!(f.keys);
                v["t_kill"] = json!(f.t_kill);
                v["t_promoted"] = json!(f.t_promoted);
            }
            out += &v.to_string();
            out.push('\n');
        }
        for e in &events {
            out += &e.to_string();
            out.push('\n');
        }
        std::fs::write(path, out).map_err(|e| format!("--events {path}: {e}"))?;
    }
    let run = Run {
        faults,
        resource,
        leftover_locks: leftover.len(),
        hung,
        elapsed_us: now_us() - start,
        until,
    };
    Ok(check(opts, &events, &run))
}

// ---------------------------------------------------------------------------------------------
// Checker.

struct Grant {
    c: String,
    child: usize,
    incarnation: usize,
    key: String,
    fence: u64,
    t_req: u64,
    t_start: u64,
    /// When the holder asked to release (before the server deleted the key).
    t_rel: Option<u64>,
    result: Option<String>,
    lost_t: Option<u64>,
    /// The holder's last local deadline, as its lease reported it (at most 10 ms stale).
    deadline: Option<u64>,
}

fn who(c: &str) -> (usize, usize) {
    let mut it = c.split('.').map(|s| s.parse::<usize>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// What the parent saw besides the children's events.
struct Run {
    faults: Vec<Fault>,
    /// Per key: the resource's acceptance list, its refusal count, the unfenced counter.
    resource: BTreeMap<String, (Vec<u64>, u64, u64)>,
    leftover_locks: usize,
    hung: usize,
    elapsed_us: u64,
    /// When the clients stopped taking leases.
    until: u64,
}

fn check(opts: &Opts, events: &[Value], run: &Run) -> bool {
    let Run {
        faults,
        resource,
        leftover_locks,
        hung,
        elapsed_us,
        until,
    } = run;
    let (leftover_locks, hung, elapsed_us) = (*leftover_locks, *hung, *elapsed_us);
    let mut grants: Vec<Grant> = Vec::new();
    let mut by_id: HashMap<(String, u64), usize> = HashMap::new();
    let (mut acc, mut refused, mut acc_after_lost, mut refused_lost) = (0u64, 0u64, 0u64, 0u64);
    let (mut write_errs, mut acq_errs, mut torn) = (0u64, 0u64, 0u64);
    // Explicit extends: granted, refused as lost, failed otherwise.
    let mut extends = [0u64; 3];
    let mut incs: BTreeMap<String, u64> = BTreeMap::new();
    // Each `lost` event: holder, when it fired, the holder's last local deadline.
    let mut losts: Vec<(String, u64, u64)> = Vec::new();
    // Lag probe events: (child, incarnation), when the 5 ms timer was set, when it woke.
    let mut lags: Vec<((usize, usize), u64, u64)> = Vec::new();
    let (mut exits, mut alive_tasks) = (0u64, 0u64);
    for e in events {
        let c = e["c"].as_str().unwrap_or("").to_string();
        let key = e["key"].as_str().unwrap_or("").to_string();
        let fence = e["fence"].as_u64().unwrap_or(0);
        let t = e["t"].as_u64().unwrap_or(0);
        match e["ev"].as_str().unwrap_or("") {
            "grant" => {
                let (child, incarnation) = who(&c);
                by_id.insert((c.clone(), fence), grants.len());
                grants.push(Grant {
                    c,
                    child,
                    incarnation,
                    key,
                    fence,
                    t_req: e["t_req"].as_u64().unwrap_or(0),
                    t_start: t,
                    t_rel: None,
                    result: None,
                    lost_t: None,
                    deadline: None,
                });
            }
            "end" => {
                if let Some(&g) = by_id.get(&(c, fence)) {
                    grants[g].t_rel = Some(t);
                    grants[g].result = e["result"].as_str().map(String::from);
                    grants[g].deadline = e["deadline"].as_u64();
                }
            }
            "lost" => {
                losts.push((c.clone(), t, e["deadline"].as_u64().unwrap_or(0)));
                if let Some(&g) = by_id.get(&(c, fence)) {
                    grants[g].lost_t = Some(t);
                }
            }
            "write" => {
                let lost = e["lost"].as_bool() == Some(true);
                if e["ok"].as_bool() == Some(true) {
                    acc += 1;
                    acc_after_lost += lost as u64;
                } else {
                    refused += 1;
                    refused_lost += lost as u64;
                }
            }
            "inc" => *incs.entry(key).or_default() += 1,
            "write_err" => write_errs += 1,
            "extend" if e["ok"].as_bool() == Some(true) => extends[0] += 1,
            "extend" if e["lost"].as_bool() == Some(true) => extends[1] += 1,
            "extend" => extends[2] += 1,
            "acq_err" => acq_errs += 1,
            "exit" => {
                exits += 1;
                alive_tasks += e["alive_tasks"].as_u64().unwrap_or(0);
            }
            "torn" => torn += 1,
            "lag" => lags.push((who(&c), e["t0"].as_u64().unwrap_or(0), t)),
            _ => {}
        }
    }
    let killed: HashMap<(usize, usize), u64> = {
        // Incarnations are numbered per child in crash order.
        let mut m = HashMap::new();
        let mut inc: HashMap<usize, usize> = HashMap::new();
        for f in faults.iter().filter(|f| f.kind == "crash") {
            if let Some(i) = f.child {
                let n = inc.entry(i).or_default();
                m.insert((i, *n), f.t0);
                *n += 1;
            }
        }
        m
    };
    let pauses = faults.iter().filter(|f| f.kind == "pause").count();
    // Writes made after a higher fence of their key was accepted (by the writes' reply times):
    // the ones the fence must refuse. A run with none never put the fence to the test.
    let stale_attempts = {
        let mut writes: BTreeMap<&str, Vec<(u64, u64, bool)>> = BTreeMap::new();
        for e in events.iter().filter(|e| e["ev"].as_str() == Some("write")) {
            writes
                .entry(e["key"].as_str().unwrap_or(""))
                .or_default()
                .push((
                    e["t"].as_u64().unwrap_or(0),
                    e["fence"].as_u64().unwrap_or(0),
                    e["ok"].as_bool() == Some(true),
                ));
        }
        let mut n = 0u64;
        for list in writes.values_mut() {
            list.sort();
            let mut high = 0;
            for &(_, fence, ok) in list.iter() {
                n += u64::from(fence < high);
                if ok {
                    high = high.max(fence);
                }
            }
        }
        n
    };
    let pauses_on_holder = faults
        .iter()
        .filter(|f| f.kind == "pause" && f.on_holder)
        .count();
    let net_faults: Vec<&Fault> = faults
        .iter()
        .filter(|f| NET_FAULTS.contains(&f.kind))
        .collect();
    let restarts: Vec<&Fault> = faults.iter().filter(|f| f.kind == "restart").collect();
    let master_kills: Vec<&Fault> = faults.iter().filter(|f| f.kind == "master kill").collect();
    let ttl_us = opts.ttl_ms * 1000;
    let paused = |child: usize, from: u64, to: u64| {
        faults
            .iter()
            .any(|f| f.kind == "pause" && f.child == Some(child) && f.t0 < to && f.t1 > from)
    };

    // 1. Fences strictly increase in grant order: a grant that finished before another began
    //    must carry a lower fence. Grants whose requests overlapped have no order to check.
    let mut order_violations = 0u64;
    let mut dup_fences = 0u64;
    let mut per_key: BTreeMap<&str, Vec<&Grant>> = BTreeMap::new();
    for g in &grants {
        per_key.entry(g.key.as_str()).or_default().push(g);
    }
    for gs in per_key.values() {
        let mut by_start: Vec<&&Grant> = gs.iter().collect();
        by_start.sort_by_key(|g| g.t_start);
        let mut by_req: Vec<&&Grant> = gs.iter().collect();
        by_req.sort_by_key(|g| g.t_req);
        let (mut j, mut max_done) = (0, 0u64);
        for b in by_req {
            while j < by_start.len() && by_start[j].t_start < b.t_req {
                max_done = max_done.max(by_start[j].fence);
                j += 1;
            }
            if max_done >= b.fence {
                order_violations += 1;
            }
        }
        let set: HashSet<u64> = gs.iter().map(|g| g.fence).collect();
        dup_fences += (gs.len() - set.len()) as u64;
    }

    // 2. The resource's own acceptance order never goes down, and holds only granted fences.
    let granted: HashSet<(&str, u64)> = grants.iter().map(|g| (g.key.as_str(), g.fence)).collect();
    let (mut stale_accepted, mut unknown, mut server_acc, mut server_ref) =
        (0u64, 0u64, 0u64, 0u64);
    for (key, (list, r, _)) in resource {
        server_acc += list.len() as u64;
        server_ref += r;
        let mut high = 0;
        for &f in list {
            if f < high {
                stale_accepted += 1;
            }
            high = high.max(f);
            if !granted.contains(&(key.as_str(), f)) {
                unknown += 1;
            }
        }
    }

    // 3. Double grants: a higher grant that began before a lower one's holder stopped.
    let end_of = |g: &Grant| -> Option<u64> {
        let killed_at = killed.get(&(g.child, g.incarnation)).copied();
        [g.t_rel, g.lost_t, killed_at].into_iter().flatten().min()
    };
    let mut doubles: BTreeMap<&'static str, u64> = BTreeMap::new();
    // Of the lapsed-lease doubles: earlier holder told lost() before the later grant, told
    // only after it, not told at all; and how many had a network fault on the holder.
    let mut lapsed_told = [0u64; 3];
    let mut lapsed_net = 0u64;
    let mut unexplained: Vec<String> = Vec::new();
    for gs in per_key.values() {
        let mut gs: Vec<&&Grant> = gs.iter().collect();
        gs.sort_by_key(|g| g.fence);
        for (bi, b) in gs.iter().enumerate() {
            // Counted once per later grant; unexplained if any overlap with it is.
            let mut verdict: Option<&'static str> = None;
            let mut lapsed: Option<&Grant> = None;
            for a in &gs[..bi] {
                let Some(end) = end_of(a) else { continue };
                if a.t_start >= b.t_start || end <= b.t_start {
                    continue;
                }
                // With `--persist` (appendfsync always) a restart keeps every acknowledged
                // grant, so it explains no overlap.
                let why = if !opts.persist
                    && restarts
                        .iter()
                        .any(|f| f.t0 >= a.t_start && f.t0 <= b.t_start)
                {
                    "server restart lost the key"
                } else if paused(a.child, a.t_start, b.t_start) {
                    "earlier holder paused past its TTL"
                } else if master_kills.iter().any(|f| {
                    // Replication is asynchronous: the replica that took over may lack the
                    // earlier grant, or its last renewals (then the key ends sooner there).
                    // Either shows up once the replica serves, before the earlier lease's
                    // deadline, so within one TTL of the promotion. Persistence on the killed
                    // master does not help: it is the replica that serves afterwards.
                    f.keys.contains(&a.key)
                        && a.t_start <= f.t_kill
                        && f.t_kill <= b.t_start
                        && b.t_start <= f.t_promoted + ttl_us
                }) {
                    "failover after a master kill lost the grant or renewal"
                } else if a.deadline.is_some_and(|d| d <= b.t_start) {
                    // Only a local deadline passed explains it: a holder told `lost()` after the
                    // later grant, or whose release found the lease gone, still believed it held
                    // while the other was granted (the overlap `--break-lease` makes).
                    lapsed = Some(a);
                    "lease lapsed, holder not paused"
                } else {
                    unexplained.push(format!(
                        "{} fence {} ({}) overlaps fence {} ({})",
                        a.key, a.fence, a.c, b.fence, b.c
                    ));
                    "UNEXPLAINED"
                };
                if verdict.is_none() || why == "UNEXPLAINED" {
                    verdict = Some(why);
                }
            }
            if let Some(why) = verdict {
                *doubles.entry(why).or_default() += 1;
                if let (Some(a), "lease lapsed, holder not paused") = (lapsed, why) {
                    let told = match a.lost_t {
                        Some(t) if t <= b.t_start => 0,
                        Some(_) => 1,
                        None => 2,
                    };
                    lapsed_told[told] += 1;
                    lapsed_net += faults
                        .iter()
                        .any(|f| f.net_on(a.child, a.t_start, b.t_start))
                        as u64;
                }
            }
        }
    }

    // 4. Every grant was released, or its process was killed and the lease left to expire.
    let mut unended = 0u64;
    let mut expired_by_crash = 0u64;
    let mut not_held = 0u64;
    let mut release_errors = 0u64;
    let mut release_error_kinds: BTreeMap<String, u64> = BTreeMap::new();
    for g in &grants {
        match g.result.as_deref() {
            Some("released") => {}
            Some("not_held") => not_held += 1,
            Some(other) => {
                release_errors += 1;
                *release_error_kinds
                    .entry(other.chars().take(90).collect())
                    .or_default() += 1;
            }
            None if killed.contains_key(&(g.child, g.incarnation)) => expired_by_crash += 1,
            None => unended += 1,
        }
    }
    // Lost leases: when was the holder told, and which fault made it lose the lease? The
    // local deadline is the drift allowance (1% of the TTL + 2 ms) or more before the server's
    // own expiry, so a holder told within that allowance after its deadline was still told
    // before the server could grant the key to anyone else.
    let drift_us = opts.ttl_ms * 1000 / 100 + 2_000;
    let (mut in_time, mut in_drift, mut late_paused, mut late_other) = (0u64, 0u64, 0u64, 0u64);
    let mut late_lagged = 0u64;
    let (mut worst_late_us, mut worst_drift_us) = (0u64, 0u64);
    // Per cause: told by the deadline, within the drift allowance, later.
    let mut lost_by: BTreeMap<&str, [u64; 3]> = BTreeMap::new();
    for (c, t, deadline) in &losts {
        let (child, t, deadline) = (who(c).0, *t, *deadline);
        let from = deadline.saturating_sub(opts.ttl_ms * 1000);
        let cause = if paused(child, from, t) {
            "pause"
        } else if let Some(f) = faults.iter().find(|f| f.net_on(child, from, t)) {
            f.kind
        } else if let Some(f) = faults
            .iter()
            .find(|f| f.child.is_none() && f.t0 <= t && f.t1 >= from)
        {
            f.kind
        } else {
            "no fault"
        };
        let slot = if t <= deadline {
            in_time += 1;
            0
        } else if t <= deadline + drift_us {
            in_drift += 1;
            worst_drift_us = worst_drift_us.max(t - deadline);
            1
        } else {
            if paused(child, deadline.saturating_sub(1), t) {
                late_paused += 1;
            } else {
                late_other += 1;
                worst_late_us = worst_late_us.max(t - deadline);
                let holder = who(c);
                late_lagged += lags
                    .iter()
                    .any(|(p, t0, t1)| *p == holder && *t0 <= t && *t1 >= deadline)
                    as u64;
            }
            2
        };
        lost_by.entry(cause).or_default()[slot] += 1;
    }

    // 5. Negative control.
    let total_incs: u64 = incs.values().sum();
    let final_sum: u64 = resource.values().map(|(_, _, n)| n).sum();
    let lost_updates = total_incs.saturating_sub(final_sum);

    // 6. On a cluster, each failover's shard serves again: per master kill or manual failover,
    //    how long until the replica took over, and until a hot key of that shard was granted
    //    again (from the kill or the FAILOVER command). A shard never granted again, when the
    //    fault ended more than 3 s before the clients stopped, fails the run.
    struct Takeover {
        kind: &'static str,
        promoted_us: u64,
        regranted_us: Option<u64>,
        must_regrant: bool,
    }
    let takeovers: Vec<Takeover> = faults
        .iter()
        .filter(|f| f.kind == "master kill" || f.kind == "manual failover")
        .map(|f| Takeover {
            kind: f.kind,
            promoted_us: f.t_promoted - f.t_kill,
            regranted_us: grants
                .iter()
                .filter(|g| f.keys.contains(&g.key) && g.t_start > f.t_promoted)
                .map(|g| g.t_start - f.t_kill)
                .min(),
            must_regrant: f.t1 + 3_000_000 < *until,
        })
        .collect();
    let not_regranted = takeovers
        .iter()
        .filter(|t| t.must_regrant && t.regranted_us.is_none())
        .count();

    let mut fault_counts: BTreeMap<&str, usize> = BTreeMap::new();
    for f in faults {
        *fault_counts.entry(f.kind).or_default() += 1;
    }
    let expected_exits = (opts.clients + killed.len()) as u64;

    let mut failures: Vec<String> = Vec::new();
    let mut require = |ok: bool, what: String| {
        if !ok {
            failures.push(what);
        }
    };
    require(!grants.is_empty(), "no grants at all".into());
    require(
        order_violations == 0,
        format!("{order_violations} fences out of grant order"),
    );
    require(
        dup_fences == 0,
        format!("{dup_fences} fences granted twice"),
    );
    require(
        stale_accepted == 0,
        format!("{stale_accepted} stale writes accepted"),
    );
    require(
        unknown == 0,
        format!("{unknown} accepted fences never granted"),
    );
    require(
        unexplained.is_empty(),
        format!("{} unexplained double grants", unexplained.len()),
    );
    require(
        unended == 0,
        format!("{unended} grants neither released nor expired"),
    );
    require(
        leftover_locks == 0,
        format!("{leftover_locks} lock keys left on the server"),
    );
    require(
        alive_tasks == 0,
        format!("{alive_tasks} tasks still running in children at exit"),
    );
    require(hung == 0, format!("{hung} children hung"));
    require(
        not_regranted == 0,
        format!("{not_regranted} shards never granted a lease again after a failover"),
    );
    require(
        exits + hung as u64 >= opts.clients as u64,
        format!("only {exits} of {} children exited cleanly", opts.clients),
    );
    require(
        pauses == 0 || lost_updates > 0,
        "negative control: pauses were injected but no unfenced update was lost".into(),
    );
    // On a cluster the fault mix leaves few pauses (four or five a run), and whether one of
    // them ends in a stale write depends on the order of two holders' writes: a run there is
    // held to this only when a stale write was made. The other deployments always are.
    require(
        pauses == 0 || refused > 0 || (opts.deploy == Deploy::Cluster && stale_attempts == 0),
        "pauses were injected but no stale write was refused".into(),
    );

    let row = |name: &str, value: String| println!("  {name:<52} {value}");
    println!(
        "\nsummary ({:.1} s, {} events, {} torn lines)",
        elapsed_us as f64 / 1e6,
        events.len(),
        torn
    );
    row("grants", grants.len().to_string());
    row(
        "acquire errors (server down, timeouts)",
        acq_errs.to_string(),
    );
    row(
        "fence order violations (must be 0)",
        order_violations.to_string(),
    );
    row("duplicate fences (must be 0)", dup_fences.to_string());
    row(
        "writes accepted (client / resource list)",
        format!("{acc} / {server_acc}"),
    );
    row(
        "  of which the writer's lease was already known lost",
        acc_after_lost.to_string(),
    );
    row(
        "stale writes refused (client / resource count)",
        format!("{refused} / {server_ref}"),
    );
    row(
        "  of which the writer's lease was already known lost",
        refused_lost.to_string(),
    );
    row(
        "stale writes accepted (must be 0)",
        stale_accepted.to_string(),
    );
    row(
        "writes made after a higher fence was accepted",
        stale_attempts.to_string(),
    );
    row(
        "accepted fences never granted (must be 0)",
        unknown.to_string(),
    );
    row("resource write errors", write_errs.to_string());
    let total_doubles: u64 = doubles.values().sum();
    row(
        "double grants (later grants overlapping a live one)",
        total_doubles.to_string(),
    );
    for (why, n) in &doubles {
        row(&format!("  {why}"), n.to_string());
        if *why == "lease lapsed, holder not paused" {
            row(
                "    holder told lost() before the later grant",
                lapsed_told[0].to_string(),
            );
            row(
                "    holder told only after the later grant began",
                lapsed_told[1].to_string(),
            );
            row(
                "    not told (deadline passed or release not held)",
                lapsed_told[2].to_string(),
            );
            row(
                "    a network fault hit the holder's link",
                lapsed_net.to_string(),
            );
        }
    }
    let faults_line = if fault_counts.is_empty() {
        "none".to_string()
    } else {
        fault_counts
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    row("faults injected", faults_line);
    row(
        "  pauses aimed at a child that held a lease",
        format!("{pauses_on_holder} of {pauses}"),
    );
    row(
        "  network faults on all links / on one child's",
        format!(
            "{} / {} ({} of them a holder's)",
            net_faults.iter().filter(|f| f.child.is_none()).count(),
            net_faults.iter().filter(|f| f.child.is_some()).count(),
            net_faults
                .iter()
                .filter(|f| f.child.is_some() && f.on_holder)
                .count()
        ),
    );
    row(
        "explicit extends: granted / lease lost / failed",
        format!("{} / {} / {}", extends[0], extends[1], extends[2]),
    );
    row(
        "leases lost (lost() fired while held)",
        losts.len().to_string(),
    );
    row("  holder told by its local deadline", in_time.to_string());
    row(
        "  told after it, within the drift allowance",
        format!(
            "{in_drift} (worst {:.1} ms after, allowance {:.1} ms)",
            worst_drift_us as f64 / 1e3,
            drift_us as f64 / 1e3
        ),
    );
    row(
        "  told late, holder's process was paused",
        late_paused.to_string(),
    );
    row(
        "  told late, not paused",
        format!(
            "{late_other} (worst {:.1} ms after the deadline)",
            worst_late_us as f64 / 1e3
        ),
    );
    row(
        "    its process's 5 ms probe timer woke >10 ms late then",
        late_lagged.to_string(),
    );
    // A paused child's probe lags too; only the others tell of a loaded machine.
    let unpaused_lags: Vec<u64> = lags
        .iter()
        .filter(|((child, _), t0, t1)| !paused(*child, *t0, *t1))
        .map(|(_, t0, t1)| (t1 - t0).saturating_sub(5_000))
        .collect();
    row(
        "  probe timer lags over 10 ms, not paused / worst",
        format!(
            "{} / {:.1} ms",
            unpaused_lags.len(),
            unpaused_lags.iter().max().copied().unwrap_or(0) as f64 / 1e3
        ),
    );
    for (cause, [a, b, c]) in &lost_by {
        row(
            &format!("  lost under {cause}"),
            format!("{}: {a} by deadline, {b} within drift, {c} late", a + b + c),
        );
    }
    row("releases that found the lease gone", not_held.to_string());
    row("release errors", release_errors.to_string());
    for (kind, n) in &release_error_kinds {
        row(&format!("  {n} x"), kind.clone());
    }
    row(
        "grants left to expire by a crash",
        expired_by_crash.to_string(),
    );
    row(
        "grants neither released nor expired (must be 0)",
        unended.to_string(),
    );
    row(
        "lock keys left after the run (must be 0)",
        leftover_locks.to_string(),
    );
    row(
        "children exited cleanly / processes started",
        format!("{exits} / {expected_exits}"),
    );
    row(
        "tasks alive in children at exit (must be 0)",
        alive_tasks.to_string(),
    );
    row(
        "negative control: unfenced increments / final counter",
        format!("{total_incs} / {final_sum}"),
    );
    row("negative control: lost updates", lost_updates.to_string());
    if opts.deploy == Deploy::Cluster {
        for kind in ["master kill", "manual failover"] {
            let ts: Vec<&Takeover> = takeovers.iter().filter(|t| t.kind == kind).collect();
            if ts.is_empty() {
                continue;
            }
            // Median and worst: a long run has dozens of failovers.
            let spread = |mut us: Vec<u64>| {
                us.sort_unstable();
                match (us.get(us.len() / 2), us.last()) {
                    (Some(m), Some(w)) => format!(
                        "median {:.2} s, worst {:.2} s",
                        *m as f64 / 1e6,
                        *w as f64 / 1e6
                    ),
                    _ => "-".into(),
                }
            };
            let promoted = spread(ts.iter().map(|t| t.promoted_us).collect());
            let regranted: Vec<u64> = ts.iter().filter_map(|t| t.regranted_us).collect();
            let never = ts.len() - regranted.len();
            row(
                &format!("{kind}s: {}; replica took over after", ts.len()),
                promoted,
            );
            row(
                "  a key of that shard granted again after",
                format!(
                    "{}{}",
                    spread(regranted),
                    if never > 0 {
                        format!(" ({never} never)")
                    } else {
                        String::new()
                    }
                ),
            );
        }
        row(
            "shards never granted again after a failover (must be 0)",
            not_regranted.to_string(),
        );
    }
    for u in unexplained.iter().take(10) {
        println!("  unexplained: {u}");
    }
    if failures.is_empty() {
        println!("\nresult: PASS");
        true
    } else {
        println!("\nresult: FAIL");
        for f in &failures {
            println!("  - {f}");
        }
        false
    }
}
