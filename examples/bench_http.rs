//! HTTP benchmark: requests/s through a route behind `LockLayer` beside the same route bare, in
//! one run, on the memory backend and on a `redis-server` this program starts on a free loopback
//! port (or `--redis URL`). The load generator is in this process too: keep-alive HTTP/1.1
//! connections over loopback, each sending requests back to back, each on its own key (so the
//! figures measure the layer's cost, not contention).
//!
//! ```text
//! cargo run --release --example bench_http --features tower
//! cargo run --release --example bench_http --features tower -- --connections 32 --seconds 3 --rounds 3
//! ```
//!
//! Rounds alternate between the routes in short slices, each round starting at the next route
//! (the order turns: the first slice of a round follows another route each time), and the
//! totals count, so load from other processes on a
//! shared machine falls on every route alike. Besides requests/s the program prints the CPU
//! time this process spent per request (from `/proc/self/stat` on Linux). Other processes' load
//! still moves it (caches, frequency, the scheduler), so compare runs made together. It is the
//! server's and the load generator's together: the generator's share is the same on every
//! route, so a ratio of these (or of requests/s) is nearer 1 than the server's alone would be.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use leasehold::Locker;
use leasehold::tower::{KeyExtractor, LockLayer};
use tokio::net::TcpStream;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Server(Child, #[allow(dead_code)] tempfile::TempDir);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis() -> Result<(Server, String), BoxError> {
    let port = StdListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let dir = tempfile::tempdir()?;
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start redis-server (is it installed?): {e}"))?;
    let server = Server(child, dir);
    let url = format!("redis://127.0.0.1:{port}/");
    let client = redis::Client::open(url.as_str())?;
    for _ in 0..200 {
        if let Ok(mut c) = client.get_connection()
            && redis::cmd("PING").query::<String>(&mut c).is_ok()
        {
            return Ok((server, url));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err("redis-server did not answer PING".into())
}

struct Args {
    connections: usize,
    seconds: f64,
    rounds: usize,
    redis: Option<String>,
    /// Measure only this route (`bare`, `memory` or `redis`), e.g. under `perf stat`.
    only: Option<String>,
}

fn args() -> Result<Args, BoxError> {
    let mut a = Args {
        connections: 32,
        seconds: 0.5,
        rounds: 10,
        redis: None,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--connections" => a.connections = value()?.parse()?,
            "--seconds" => a.seconds = value()?.parse()?,
            "--rounds" => a.rounds = value()?.parse()?,
            "--redis" => a.redis = Some(value()?),
            "--only" => a.only = Some(value()?),
            other => return Err(format!("unknown argument `{other}`").into()),
        }
    }
    if a.connections == 0 || a.rounds == 0 || a.seconds <= 0.0 {
        return Err("connections, rounds and seconds must be positive".into());
    }
    if let Some(o) = &a.only
        && !["bare", "memory", "redis"].contains(&o.as_str())
    {
        return Err(format!("--only takes bare, memory or redis, not `{o}`").into());
    }
    Ok(a)
}

/// Sends POSTs to `{prefix}/{conn}` on `connections` keep-alive connections for `dur`.
/// Returns (200 answers, elapsed seconds, non-200 answers).
async fn load(
    addr: SocketAddr,
    prefix: &str,
    connections: usize,
    dur: Duration,
) -> Result<(f64, f64, u64), BoxError> {
    let done = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let bad = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..connections {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let (done, ok, bad) = (done.clone(), ok.clone(), bad.clone());
        let uri = format!("{prefix}/{c}");
        tasks.push(tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                let req = axum::http::Request::post(&uri)
                    .header("host", "bench")
                    .body(Full::new(Bytes::new()))?;
                tx.ready().await?;
                let res = tx.send_request(req).await?;
                let status = res.status();
                res.into_body().collect().await?;
                if status == axum::http::StatusCode::OK {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<(), BoxError>(())
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(dur).await;
    done.store(true, Ordering::Relaxed);
    let counted = ok.load(Ordering::Relaxed);
    let elapsed = start.elapsed();
    for t in tasks {
        t.await??;
    }
    Ok((
        counted as f64,
        elapsed.as_secs_f64(),
        bad.load(Ordering::Relaxed),
    ))
}

/// CPU time (user + system) this process has used, from `/proc/self/stat`; `None` elsewhere.
fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // The kernel reports in USER_HZ, 100 on Linux.
    Some(Duration::from_millis(ticks * 10))
}

#[derive(Default, Clone, Copy)]
struct Total {
    requests: f64,
    secs: f64,
    cpu: Option<Duration>,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let a = args()?;
    let (_server, url) = match &a.redis {
        Some(u) => (None, u.clone()),
        None => {
            let (s, u) = start_redis()?;
            (Some(s), u)
        }
    };
    let memory = Locker::memory();
    let redis = Locker::redis(&url)
        .await?
        .with_prefix(format!("bench-http-{}", std::process::id()))?;
    let handler = || post(|| async { "ok" });
    let app = Router::new()
        .route("/bare/{id}", handler())
        .merge(
            Router::new()
                .route("/memory/{id}", handler())
                .route_layer(LockLayer::new(memory, KeyExtractor::route_param("id"))),
        )
        .merge(
            Router::new()
                .route("/redis/{id}", handler())
                .route_layer(LockLayer::new(redis, KeyExtractor::route_param("id"))),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    let dur = Duration::from_secs_f64(a.seconds);
    println!(
        "bench_http: {} connections, {} rounds of {:.2} s per route, server and load generator in one process on {} cores",
        a.connections,
        a.rounds,
        a.seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let routes = ["/bare", "/memory", "/redis"];
    let measured = |route: &str| a.only.as_ref().is_none_or(|o| route[1..] == *o);
    // Warm-up: connections, the Redis scripts, the renewal driver.
    let mut warm = 0.0;
    for route in routes.iter().filter(|r| measured(r)) {
        warm += load(addr, route, a.connections, Duration::from_millis(300))
            .await?
            .0;
    }
    let mut totals = [Total::default(); 3];
    let mut errors = 0;
    for round in 0..a.rounds {
        // Each round starts at the next route: a slice can be slowed by what the one before
        // it left behind, and the first slice of a round follows a different one each time.
        for k in 0..routes.len() {
            let i = (k + round) % routes.len();
            let route = routes[i];
            if !measured(route) {
                continue;
            }
            let cpu0 = cpu_time();
            let (n, secs, bad) = load(addr, route, a.connections, dur).await?;
            let cpu = cpu_time().zip(cpu0).map(|(b, a)| b.saturating_sub(a));
            errors += bad;
            let t = &mut totals[i];
            t.requests += n;
            t.secs += secs;
            t.cpu = match (t.cpu, cpu) {
                (Some(x), Some(y)) => Some(x + y),
                (None, y) if t.requests == n => y,
                _ => None,
            };
        }
    }
    let rps = |t: &Total| t.requests / t.secs;
    let cpu_us = |t: &Total| t.cpu.map(|c| c.as_secs_f64() * 1e6 / t.requests);
    let fmt_cpu = |t: &Total| cpu_us(t).map_or("n/a".to_owned(), |u| format!("{u:.1} us"));
    if let Some(only) = &a.only {
        let i = routes.iter().position(|r| r[1..] == *only).unwrap_or(0);
        let t = &totals[i];
        // Under `perf stat`, divide the process's counts by the requests of every phase.
        println!(
            "only {only}: {:.0} req/s   CPU/request {}   {} requests measured, {warm} in the warm-up",
            rps(t),
            fmt_cpu(t),
            t.requests,
        );
        return Ok(());
    }
    let [bare, mem, red] = totals;
    println!("totals over {} rounds:", a.rounds);
    println!(
        "  bare route                 {:>9.0} req/s   CPU/request {}",
        rps(&bare),
        fmt_cpu(&bare)
    );
    let ratio = rps(&mem) / rps(&bare);
    println!(
        "  LockLayer, memory backend  {:>9.0} req/s   CPU/request {}   throughput {ratio:.2}x bare (target >= 0.90x: {})",
        rps(&mem),
        fmt_cpu(&mem),
        if ratio >= 0.9 { "met" } else { "MISSED" }
    );
    if let (Some(b), Some(m)) = (cpu_us(&bare), cpu_us(&mem)) {
        println!(
            "    by CPU per request (this process: server and load generator): {:.2}x bare",
            b / m
        );
    }
    println!(
        "  LockLayer, redis backend   {:>9.0} req/s   CPU/request {}   throughput {:.2}x bare (each request waits for two Redis round trips)",
        rps(&red),
        fmt_cpu(&red),
        rps(&red) / rps(&bare)
    );
    if errors > 0 {
        println!("  non-200 answers: {errors} (keys are per connection, so there should be none)");
    }
    Ok(())
}
