//! Test support: real `redis-server` / `valkey-server` processes on free loopback ports, in
//! temporary directories, that tests can kill, restart and flush.
#![allow(dead_code)]

pub mod proxy;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Which server binary to run.
#[derive(Clone, Copy, Debug)]
pub enum Flavor {
    Redis,
    Valkey,
}

impl Flavor {
    pub fn binary(self) -> &'static str {
        match self {
            Flavor::Redis => "redis-server",
            Flavor::Valkey => "valkey-server",
        }
    }
}

/// Whether a binary is on PATH.
pub fn has_binary(name: &str) -> bool {
    Command::new(name)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// A runtime of its own, as each `#[tokio::test]` has: for tests of a `Locker` used from one
/// runtime after another.
#[allow(dead_code)] // Not every test binary that includes this module uses it.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// A free port whose cluster-bus twin (port + 10000) is free too.
fn free_cluster_port() -> u16 {
    for _ in 0..200 {
        let Ok(l) = TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(port) = l.local_addr().map(|a| a.port()) else {
            continue;
        };
        if port < 55_535 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port pair for a cluster node")
}

/// Makes a client for a URL that trusts the given CA (PEM); set by `support/tls.rs`.
pub type TlsClient = fn(String, Vec<u8>) -> redis::RedisResult<redis::Client>;

/// One server process owned by a test; killed when dropped.
pub struct Server {
    pub flavor: Flavor,
    pub port: u16,
    pub persist: bool,
    /// Extra configuration arguments (cluster mode).
    extra: Vec<String>,
    /// The test certificate authority in PEM, when the server speaks only TLS.
    pub tls_ca: Option<Vec<u8>>,
    tls_client: Option<TlsClient>,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Server {
    /// Starts a server without persistence. Panics loudly if the binary is missing: a test that
    /// needs a server never skips silently.
    pub fn start(flavor: Flavor) -> Server {
        Server::start_with(flavor, false)
    }

    /// Starts a server, with append-only persistence when `persist`.
    pub fn start_with(flavor: Flavor, persist: bool) -> Server {
        Server::start_full(flavor, persist, free_port, Vec::new())
    }

    /// Starts a server without persistence, with `extra` arguments on its command line.
    pub fn start_with_args(flavor: Flavor, extra: &[&str]) -> Server {
        let extra = extra.iter().map(|a| (*a).to_owned()).collect();
        Server::start_full(flavor, false, free_port, extra)
    }

    /// Starts a replica of `master` and waits until its replication link is up.
    pub fn start_replica_of(master: &Server) -> Server {
        // The default waits 5 s for more replicas before a diskless full sync.
        let _: () = master.cmd(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
        let extra = vec![
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            master.port.to_string(),
        ];
        let replica = Server::start_full(master.flavor, false, free_port, extra);
        let start = Instant::now();
        loop {
            let info: String = replica.cmd(&["INFO", "replication"]);
            if info.contains("master_link_status:up") {
                return replica;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the replica never synced"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts a server on a port from `pick`. A port found free can be taken before the
    /// server binds it (by another test's server, or as the local port of some connection;
    /// seen in CI for a cluster node's bus port): the server then exits at once, and it is
    /// started again on another port.
    fn start_full(flavor: Flavor, persist: bool, pick: fn() -> u16, extra: Vec<String>) -> Server {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("temp dir");
            let mut s = Server::unspawned(flavor, persist, pick(), extra.clone(), dir);
            if s.try_spawn() {
                return s;
            }
        }
        panic!(
            "{} exited at start on five free ports in a row",
            flavor.binary()
        )
    }

    fn unspawned(
        flavor: Flavor,
        persist: bool,
        port: u16,
        extra: Vec<String>,
        dir: tempfile::TempDir,
    ) -> Server {
        assert!(
            has_binary(flavor.binary()),
            "`{}` is not on PATH: install it (the README's test command provisions it)",
            flavor.binary()
        );
        Server {
            flavor,
            port,
            persist,
            extra,
            tls_ca: None,
            tls_client: None,
            dir,
            child: None,
        }
    }

    fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    fn spawn(&mut self) {
        self.launch(&[]);
        self.wait_for("answer PING", Server::ping);
    }

    /// As [`spawn`](Self::spawn), but false when the process exits before it answers (a port
    /// it could not bind).
    fn try_spawn(&mut self) -> bool {
        self.launch(&[]);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if self.ping() {
                return true;
            }
            if let Some(c) = self.child.as_mut()
                && matches!(c.try_wait(), Ok(Some(_)))
            {
                self.child = None;
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "{} on port {} did not answer PING",
            self.flavor.binary(),
            self.port
        );
    }

    /// Starts the process with `more` arguments after the usual ones, without waiting for it.
    fn launch(&mut self, more: &[&str]) {
        let mut cmd = Command::new(self.flavor.binary());
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(self.dir())
            .arg("--save")
            .arg("")
            .arg("--appendonly")
            .arg(if self.persist { "yes" } else { "no" })
            .args(&self.extra)
            .args(more)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("spawn server"));
    }

    fn wait_for(&self, what: &str, ready: impl Fn(&Server) -> bool) {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if ready(self) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "{} on port {} did not {what}",
            self.flavor.binary(),
            self.port
        );
    }

    fn ping(&self) -> bool {
        let Ok(client) = self.client() else {
            return false;
        };
        let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(200)) else {
            return false;
        };
        redis::cmd("PING").query::<String>(&mut c).is_ok()
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// A client for test-side commands (trusting the test CA on a TLS server).
    fn client(&self) -> redis::RedisResult<redis::Client> {
        match (&self.tls_ca, self.tls_client) {
            (Some(ca), Some(make)) => make(self.url(), ca.clone()),
            _ => redis::Client::open(self.url()),
        }
    }

    /// Starts a server in `dir` with extra arguments on `port`; with `tls`, the server speaks
    /// TLS there and `tls.0` (a CA in PEM) with `tls.1` makes the test-side clients. For
    /// `support/tls.rs`.
    pub fn start_configured(
        flavor: Flavor,
        port: u16,
        extra: Vec<String>,
        dir: tempfile::TempDir,
        tls: Option<(Vec<u8>, TlsClient)>,
    ) -> Server {
        let mut s = Server::unspawned(flavor, false, port, extra, dir);
        if let Some((ca, make)) = tls {
            s.tls_ca = Some(ca);
            s.tls_client = Some(make);
        }
        s.spawn();
        s
    }

    /// Creates the lock user of `docs/leasehold.acl` (the rule the README tells operators to
    /// use) and returns a URL that logs in as it.
    pub fn acl_user_url(&self) -> String {
        self.acl_user_url_for("leasehold")
    }

    /// Creates (or resets to its rule) the user `name` of `docs/leasehold.acl` and returns a URL
    /// that logs in as it.
    pub fn acl_user_url_for(&self, name: &str) -> String {
        let file = include_str!("../../docs/leasehold.acl");
        let rule = file
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("docs/leasehold.acl has no user `{name}`"));
        let mut words = rule.split_whitespace();
        assert_eq!(
            words.next(),
            Some("user"),
            "an ACL file line starts with `user`"
        );
        let name = words.next().expect("user name");
        let mut setuser = redis::cmd("ACL");
        setuser.arg("SETUSER").arg(name);
        let mut password = None;
        for w in words {
            setuser.arg(w);
            if let Some(p) = w.strip_prefix('>') {
                password = Some(p.to_owned());
            }
        }
        let _: () = setuser.query(&mut self.conn()).expect("ACL SETUSER");
        let password = password.expect("the rule sets a password");
        format!("redis://{name}:{password}@127.0.0.1:{}/", self.port)
    }

    /// SIGKILL: no shutdown, nothing saved beyond what the AOF already has.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the server stops answering while its connections stay open (a stalled
    /// process, not a dead one), until the returned guard is dropped (SIGCONT).
    pub fn pause(&self) -> Paused {
        let pid = self.child.as_ref().expect("the server is running").id();
        signal(pid, "STOP");
        Paused(pid)
    }

    /// Kills and starts again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Kills the server and starts it again on the dataset it last saved (`SAVE`), loading it
    /// slowly (`key_load_delay` per key) so that it answers `LOADING` to most commands for a
    /// while; returns as soon as it does, while it is still loading.
    pub fn restart_loading(&mut self, key_load_delay: Duration) {
        self.kill();
        let delay = key_load_delay.as_micros().to_string();
        self.launch(&[
            "--key-load-delay",
            &delay,
            // Loading stops to serve clients every this many bytes (default 2 MiB: never, for a
            // small dataset).
            "--loading-process-events-interval-bytes",
            "1024",
        ]);
        self.wait_for("start loading", |s| s.loading() == Some(true));
    }

    /// Whether the server is loading its dataset (`INFO persistence`, which it answers while
    /// loading); `None` when it cannot be asked.
    pub fn loading(&self) -> Option<bool> {
        let mut c = self
            .client()
            .ok()?
            .get_connection_with_timeout(Duration::from_millis(200))
            .ok()?;
        let info: String = redis::cmd("INFO").arg("persistence").query(&mut c).ok()?;
        info_line(&info, "loading").map(|v| v == "1")
    }

    /// One field of `INFO section` (empty when the server does not report it).
    pub fn info_field(&self, section: &str, field: &str) -> String {
        let info: String = self.cmd(&["INFO", section]);
        info_line(&info, field).unwrap_or_default().to_owned()
    }

    /// Script calls (`EVALSHA` and `EVAL`) this server has run so far.
    pub fn script_calls(&self) -> u64 {
        ["cmdstat_evalsha", "cmdstat_eval"]
            .iter()
            .map(|field| {
                let line = self.info_field("commandstats", field);
                line.split(',')
                    .find_map(|f| f.strip_prefix("calls="))
                    .map_or(0, |n| n.parse().expect("a count"))
            })
            .sum()
    }

    /// Waits up to 5 s for `channel` to have a subscriber on this server.
    pub async fn wait_for_subscriber(&self, channel: &str) {
        let started = Instant::now();
        loop {
            let (_, n): (String, i64) = self.cmd(&["PUBSUB", "NUMSUB", channel]);
            if n > 0 {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "nobody subscribed to {channel} on port {}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Kills this server's pub/sub connections. Seen in CI: a kill right after `NUMSUB`
    /// counted a subscriber found no pub/sub client yet, so it tries for up to 3 s, then
    /// fails showing the clients.
    pub async fn kill_subscribers(&self) {
        let started = Instant::now();
        while self.cmd::<i64>(&["CLIENT", "KILL", "TYPE", "pubsub"]) == 0 {
            if started.elapsed() > Duration::from_secs(3) {
                let clients: String = self.cmd(&["CLIENT", "LIST"]);
                panic!("no pub/sub client to kill; clients:\n{clients}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The server's clock (`TIME`), in microseconds.
    pub fn time_micros(&self) -> u64 {
        let t: Vec<u64> = self.cmd(&["TIME"]);
        t[0] * 1_000_000 + t[1]
    }

    /// A plain synchronous connection for test-side commands.
    pub fn conn(&self) -> redis::Connection {
        self.client()
            .and_then(|c| c.get_connection())
            .expect("test connection")
    }

    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query(&mut self.conn()).expect("test command")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The value of `field` in an `INFO` reply.
fn info_line<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        l.strip_prefix(field)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}

/// A cluster of real server processes, made with `redis-cli --cluster create`.
pub struct Cluster {
    pub nodes: Vec<Server>,
}

impl Cluster {
    /// Starts `masters` masters, each with `replicas` replicas, and waits until every node
    /// reports the cluster healthy with all slots covered.
    pub fn start(flavor: Flavor, masters: usize, replicas: usize) -> Cluster {
        assert!(
            has_binary("redis-cli"),
            "`redis-cli` is not on PATH: it creates the test cluster (Debian's redis-tools)"
        );
        let nodes: Vec<Server> = (0..masters * (1 + replicas))
            .map(|_| {
                let extra = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    "--repl-diskless-sync-delay",
                    "0",
                ]
                .map(String::from)
                .to_vec();
                Server::start_full(flavor, false, free_cluster_port, extra)
            })
            .collect();
        if masters == 1 && replicas == 0 {
            // `redis-cli --cluster create` wants three masters; one node takes every slot
            // itself (and then reports its own host as "" in `CLUSTER SLOTS`).
            let _: () = nodes[0].cmd(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
            let cluster = Cluster { nodes };
            let start = Instant::now();
            while !cluster.healthy() {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "the one-node cluster did not become healthy"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            return cluster;
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .arg("--cluster-replicas")
            .arg(replicas.to_string())
            .arg("--cluster-yes")
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Cluster { nodes };
        let start = Instant::now();
        // Healthy, and every replica attached and in sync: a replica still syncing cannot be
        // promoted, so a failover test would wait forever.
        while !cluster.healthy() || !cluster.replicas_synced(masters * replicas) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the cluster did not become healthy"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster
    }

    fn healthy(&self) -> bool {
        self.nodes.iter().all(|n| {
            let Ok(info) = redis::cmd("CLUSTER")
                .arg("INFO")
                .query::<String>(&mut n.conn())
            else {
                return false;
            };
            info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
        })
    }

    fn replicas_synced(&self, expected: usize) -> bool {
        let synced = self
            .nodes
            .iter()
            .filter(|n| {
                redis::cmd("INFO")
                    .arg("replication")
                    .query::<String>(&mut n.conn())
                    .is_ok_and(|info| {
                        info.contains("role:slave") && info.contains("master_link_status:up")
                    })
            })
            .count();
        synced == expected
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Server::url).collect()
    }

    /// A command on whichever node owns its key.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let client = redis::cluster::ClusterClient::new(self.urls()).expect("cluster client");
        let mut conn = client.get_connection().expect("cluster connection");
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query(&mut conn).expect("cluster test command")
    }
}

/// A server stopped by [`Server::pause`]; continued when dropped, also when the test fails.
pub struct Paused(u32);

impl Drop for Paused {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{sig} {pid} failed");
}

/// Asks for `name` until it is granted, for at most `limit`, for tests of a connection that went
/// bad: the lease, and how many asks failed first. Each failure must be one a retry may cure.
pub async fn granted_again(
    locker: &lock_core::Locker,
    name: &str,
    opts: &lock_core::LockOptions,
    limit: Duration,
) -> (lock_core::Lease, u32) {
    let started = Instant::now();
    let mut failures = 0;
    loop {
        match locker.try_acquire(name, opts).await {
            Ok(lease) => return (lease, failures),
            Err(e) => {
                assert!(e.is_transient(), "{e:?}");
                failures += 1;
            }
        }
        assert!(
            started.elapsed() < limit,
            "still failing {limit:?} after the connection went bad ({failures} failures)"
        );
    }
}

/// A handoff between two waiters of one locker, timed against an uncontended acquire over the
/// same link.
pub struct Handoff {
    /// From the first holder letting go to the waiter's grant.
    pub handoff: Duration,
    /// One acquire of another key, alone, after `slow`.
    pub uncontended: Duration,
    pub first_fence: lock_core::Fence,
    /// The waiter's lease, and the uncontended one: the caller releases them.
    pub second: lock_core::Lease,
    pub alone: lock_core::Lease,
}

/// The first holder takes `key` with `held`; a waiter queues for it with `wait`; once it has
/// queued (it sends nothing while the turn is held), `slow()` slows the link, an uncontended
/// acquire is timed, and `let_go` ends the first lease (a release, a drop).
pub async fn timed_handoff<F: std::future::Future<Output = ()>>(
    locker: &lock_core::Locker,
    key: &str,
    held: &lock_core::LockOptions,
    wait: &lock_core::LockOptions,
    slow: impl FnOnce(),
    let_go: impl FnOnce(lock_core::Lease) -> F,
) -> Handoff {
    let first = locker.acquire(key, held).await.expect("first");
    let first_fence = first.fence();
    let waiter = tokio::spawn({
        let (locker, wait, key) = (locker.clone(), wait.clone(), key.to_owned());
        async move {
            let lease = locker.acquire(&key, &wait).await;
            (lease, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    slow();
    let started = Instant::now();
    let alone = locker
        .acquire(&format!("{key}:alone"), wait)
        .await
        .expect("uncontended");
    let uncontended = started.elapsed();
    let started = Instant::now();
    let_go(first).await;
    let (second, granted) = waiter.await.expect("waiter task");
    let second = second.expect("the waiter is granted the key");
    assert!(
        second.fence() > first_fence,
        "{:?} after {first_fence:?}",
        second.fence()
    );
    Handoff {
        handoff: granted - started,
        uncontended,
        first_fence,
        second,
        alone,
    }
}

/// Sets the key patterns of the ACL user `some-keys` (every command and channel allowed).
pub fn some_keys(server: &Server, keys: &[&str]) {
    let mut rule = vec![
        "ACL",
        "SETUSER",
        "some-keys",
        "on",
        ">pw",
        "&*",
        "+@all",
        "resetkeys",
    ];
    rule.extend_from_slice(keys);
    let _: () = server.cmd(&rule);
}
