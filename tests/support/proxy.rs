//! A TCP proxy of our own between a client and a real server, for faults a server cannot
//! inject itself: replies lost after the command ran, and slow replies.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Forwards loopback connections to the server; drops the next `to_drop` server replies that
/// start with `pattern`, closing that connection instead of delivering them.
pub struct Proxy {
    pub port: u16,
    pattern: Arc<std::sync::Mutex<Vec<u8>>>,
    to_drop: Arc<AtomicUsize>,
    /// How many replies were dropped so far.
    pub dropped: Arc<AtomicUsize>,
    /// Delay added to every reply, in microseconds (0: none).
    delay_us: Arc<AtomicU64>,
}

impl Proxy {
    pub async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let proxy = Proxy {
            port,
            pattern: Arc::default(),
            to_drop: Arc::default(),
            dropped: Arc::default(),
            delay_us: Arc::default(),
        };
        let (pattern, to_drop, dropped, delay) = (
            proxy.pattern.clone(),
            proxy.to_drop.clone(),
            proxy.dropped.clone(),
            proxy.delay_us.clone(),
        );
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let faults = Faults {
                    pattern: pattern.clone(),
                    to_drop: to_drop.clone(),
                    dropped: dropped.clone(),
                    delay: delay.clone(),
                };
                tokio::spawn(pipe(client, server, faults));
            }
        });
        proxy
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Arms the proxy: the next `n` replies starting with `pattern` are lost.
    pub fn drop_replies(&self, pattern: &[u8], n: usize) {
        *self.pattern.lock().expect("pattern") = pattern.to_vec();
        self.to_drop.store(n, Ordering::SeqCst);
    }

    /// Delays every reply from now on by `delay` (zero: no delay), as a slow network would.
    pub fn delay_replies(&self, delay: Duration) {
        self.delay_us
            .store(delay.as_micros() as u64, Ordering::SeqCst);
    }
}

/// The faults one proxied connection applies, shared with the `Proxy` that arms them.
struct Faults {
    pattern: Arc<std::sync::Mutex<Vec<u8>>>,
    to_drop: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
    delay: Arc<AtomicU64>,
}

async fn pipe(client: TcpStream, server: TcpStream, faults: Faults) {
    let Faults {
        pattern,
        to_drop,
        dropped,
        delay,
    } = faults;
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let upstream = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = cr.read(&mut buf).await {
            if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = sr.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        let wait = delay.load(Ordering::SeqCst);
        if wait > 0 {
            tokio::time::sleep(Duration::from_micros(wait)).await;
        }
        let matches = {
            let p = pattern.lock().expect("pattern");
            !p.is_empty() && chunk.starts_with(&p)
        };
        if matches
            && to_drop
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| d.checked_sub(1))
                .is_ok()
        {
            dropped.fetch_add(1, Ordering::SeqCst);
            // Both halves dropped: the client sees its connection die with the reply unsent.
            break;
        }
        if cw.write_all(chunk).await.is_err() {
            break;
        }
    }
    upstream.abort();
}
