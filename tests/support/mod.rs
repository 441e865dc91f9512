//! Test support: real `redis-server` / `valkey-server` processes on free loopback ports, in
//! temporary directories, that tests can kill, restart and flush.
#![allow(dead_code)]

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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// One server process owned by a test; killed when dropped.
pub struct Server {
    pub flavor: Flavor,
    pub port: u16,
    pub persist: bool,
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
        assert!(
            has_binary(flavor.binary()),
            "`{}` is not on PATH: install it (the README's test command provisions it)",
            flavor.binary()
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let mut s = Server {
            flavor,
            port: free_port(),
            persist,
            dir,
            child: None,
        };
        s.spawn();
        s
    }

    fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    fn spawn(&mut self) {
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
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("spawn server"));
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "{} on port {} did not answer PING",
            self.flavor.binary(),
            self.port
        );
    }

    fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(200)) else {
            return false;
        };
        redis::cmd("PING").query::<String>(&mut c).is_ok()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// SIGKILL: no shutdown, nothing saved beyond what the AOF already has.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills and starts again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// A plain synchronous connection for test-side commands.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
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
