//! A TCP proxy of our own between a client and a real server, for faults a server cannot
//! inject itself: replies lost after the command ran, slow replies, and network faults
//! (latency, stalls, cuts) for the torture harness.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The network state every connection of one proxy follows.
#[derive(Clone, Copy, Default)]
struct NetState {
    /// Nothing is forwarded either way; connections stay open.
    stalled: bool,
    /// The listener is closed (new connections refused).
    cut: bool,
    /// Bumped by each cut: a connection opened in an earlier epoch is closed.
    epoch: u64,
}

/// Forwards loopback connections to the server; drops the next `to_drop` server replies that
/// start with `pattern`, closing that connection instead of delivering them.
pub struct Proxy {
    pub port: u16,
    pattern: Arc<std::sync::Mutex<Vec<u8>>>,
    to_drop: Arc<AtomicUsize>,
    /// What a matching reply's `pattern` is replaced with instead of being dropped (`None`:
    /// dropped).
    replacement: Arc<std::sync::Mutex<Option<Vec<u8>>>>,
    /// How many replies were dropped (or replaced) so far.
    pub dropped: Arc<AtomicUsize>,
    /// Delay added to every reply, in microseconds (0: none).
    delay_us: Arc<AtomicU64>,
    /// How many reads of replies the reply delay has held back so far (a read that started
    /// while it was set).
    pub delayed: Arc<AtomicUsize>,
    /// One-way latency added to every chunk in both directions, in microseconds (0: none).
    latency_us: Arc<AtomicU64>,
    /// Per connection, in the order they were accepted: latency added to its requests and to
    /// its replies alone, in microseconds.
    own_latency_us: Arc<std::sync::Mutex<Vec<[Arc<AtomicU64>; 2]>>>,
    state: watch::Sender<NetState>,
}

impl Proxy {
    pub async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (state, rx) = watch::channel(NetState::default());
        let proxy = Proxy {
            port,
            pattern: Arc::default(),
            to_drop: Arc::default(),
            replacement: Arc::default(),
            dropped: Arc::default(),
            delay_us: Arc::default(),
            delayed: Arc::default(),
            latency_us: Arc::default(),
            own_latency_us: Arc::default(),
            state,
        };
        let faults = Faults {
            pattern: proxy.pattern.clone(),
            to_drop: proxy.to_drop.clone(),
            replacement: proxy.replacement.clone(),
            dropped: proxy.dropped.clone(),
            delay: proxy.delay_us.clone(),
            delayed: proxy.delayed.clone(),
            latency: proxy.latency_us.clone(),
            own_latency: proxy.own_latency_us.clone(),
        };
        tokio::spawn(serve(listener, port, upstream, faults, rx));
        proxy
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Arms the proxy: the next `n` replies starting with `pattern` are lost.
    pub fn drop_replies(&self, pattern: &[u8], n: usize) {
        *self.replacement.lock().expect("replacement") = None;
        *self.pattern.lock().expect("pattern") = pattern.to_vec();
        self.to_drop.store(n, Ordering::SeqCst);
    }

    /// Arms the proxy: in the next `n` replies starting with `pattern`, `pattern` is replaced
    /// by `replacement` (a reply in a shape the server never gives).
    pub fn replace_replies(&self, pattern: &[u8], replacement: &[u8], n: usize) {
        *self.replacement.lock().expect("replacement") = Some(replacement.to_vec());
        *self.pattern.lock().expect("pattern") = pattern.to_vec();
        self.to_drop.store(n, Ordering::SeqCst);
    }

    /// Delays every reply from now on by `delay` (zero: no delay), as a slow network would.
    /// Replies wait one after another, so the delays of queued replies add up.
    pub fn delay_replies(&self, delay: Duration) {
        self.delay_us
            .store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    /// Adds `one_way` to every chunk read from now on, in both directions (zero: none). Unlike
    /// [`delay_replies`](Self::delay_replies), chunks are delayed in parallel, as on a long
    /// link: order and throughput are kept, a round trip takes twice `one_way` longer.
    pub fn set_latency(&self, one_way: Duration) {
        self.latency_us
            .store(one_way.as_micros() as u64, Ordering::SeqCst);
    }

    /// How many connections the proxy has made to the server so far (one per client connection
    /// it forwards).
    pub fn connections(&self) -> usize {
        self.own_latency_us.lock().expect("connections").len()
    }

    /// Adds `one_way` to every request chunk the `index`th connection (from 0, in the order
    /// they were accepted) sends from now on, and to no other connection's: one of a client's
    /// connections on a slower path than the others.
    pub fn delay_requests_of(&self, index: usize, one_way: Duration) {
        self.own_latency_us.lock().expect("connections")[index][0]
            .store(one_way.as_micros() as u64, Ordering::SeqCst);
    }

    /// From now on nothing read on the `index`th connection reaches the other side, in either
    /// direction, while the connection stays open: a half-open connection, whose peer went away
    /// without closing it. Other connections, and new ones, are not touched.
    pub fn black_hole(&self, index: usize) {
        let hour = Duration::from_secs(3_600).as_micros() as u64;
        for direction in &self.own_latency_us.lock().expect("connections")[index] {
            direction.store(hour, Ordering::SeqCst);
        }
    }

    /// While `on`, nothing is forwarded in either direction and connections stay open, as
    /// when a link drops packets; what was sent meanwhile is delivered when the stall ends.
    pub fn stall(&self, on: bool) {
        self.state.send_modify(|s| s.stalled = on);
    }

    /// `on`: every open connection is closed at once and new ones are refused (the listener
    /// is closed) until `cut(false)` opens it again on the same port.
    pub fn cut(&self, on: bool) {
        self.state.send_modify(|s| {
            if on && !s.cut {
                s.epoch += 1;
            }
            s.cut = on;
        });
    }
}

/// The faults one proxied connection applies, shared with the `Proxy` that arms them.
#[derive(Clone)]
struct Faults {
    pattern: Arc<std::sync::Mutex<Vec<u8>>>,
    to_drop: Arc<AtomicUsize>,
    replacement: Arc<std::sync::Mutex<Option<Vec<u8>>>>,
    dropped: Arc<AtomicUsize>,
    delay: Arc<AtomicU64>,
    delayed: Arc<AtomicUsize>,
    latency: Arc<AtomicU64>,
    own_latency: Arc<std::sync::Mutex<Vec<[Arc<AtomicU64>; 2]>>>,
}

/// Aborts the task when dropped, so a connection's reader dies with it.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn serve(
    mut listener: TcpListener,
    port: u16,
    upstream: u16,
    faults: Faults,
    mut state: watch::Receiver<NetState>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => Some(a),
            cut = state.wait_for(|s| s.cut) => {
                if cut.is_err() {
                    return;
                }
                None
            }
        };
        let Some(accepted) = accepted else {
            // Cut: refuse connections until the cut ends, then listen on the same port again.
            drop(listener);
            if state.wait_for(|s| !s.cut).await.is_err() {
                return;
            }
            listener = match rebind(port).await {
                Some(l) => l,
                None => return,
            };
            continue;
        };
        let Ok((client, _)) = accepted else { break };
        // A connection accepted just as a cut began is refused too; one cut after this point
        // changes the epoch, which closes it.
        let NetState { cut, epoch, .. } = *state.borrow();
        if cut {
            continue;
        }
        let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
            continue;
        };
        let own: [Arc<AtomicU64>; 2] = Default::default();
        faults
            .own_latency
            .lock()
            .expect("connections")
            .push(own.clone());
        tokio::spawn(pipe(
            client,
            server,
            faults.clone(),
            own,
            state.clone(),
            epoch,
        ));
    }
}

/// Listens on `port` again after a cut; the port was ours a moment ago, so a few tries suffice
/// unless another process took it.
async fn rebind(port: u16) -> Option<TcpListener> {
    for _ in 0..100 {
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)).await {
            return Some(l);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("proxy: cannot listen on port {port} again after a cut");
    None
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    faults: Faults,
    own_latency: [Arc<AtomicU64>; 2],
    mut state: watch::Receiver<NetState>,
    epoch: u64,
) {
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let latency = faults.latency.clone();
    let [requests, replies] = own_latency;
    // Either direction ending (a peer closed, a reply dropped) or a cut closes both.
    tokio::select! {
        _ = forward(cr, sw, None, [latency.clone(), requests], state.clone()) => {}
        _ = forward(sr, cw, Some(faults), [latency, replies], state.clone()) => {}
        _ = state.wait_for(|s| s.epoch != epoch) => {}
    }
}

/// Copies one direction. `replies`: this is the server-to-client direction, where reply
/// dropping and the serial reply delay apply. `latency`: the proxy's and this direction's own,
/// added together.
async fn forward(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    replies: Option<Faults>,
    latency: [Arc<AtomicU64>; 2],
    mut state: watch::Receiver<NetState>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let serial_delay = replies
        .as_ref()
        .map(|f| (f.delay.clone(), f.delayed.clone()));
    // Reading goes on while the writer waits out latency or a stall; each chunk carries the
    // time it is due.
    let _reader = AbortOnDrop(tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buf).await {
            if n == 0 {
                break;
            }
            // The serial reply delay holds up reading too: replies that arrive meanwhile
            // are read, and delayed, together with this one.
            if let Some((delay, delayed)) = &serial_delay {
                let wait = delay.load(Ordering::SeqCst);
                if wait > 0 {
                    delayed.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_micros(wait)).await;
                }
            }
            let added: u64 = latency.iter().map(|l| l.load(Ordering::SeqCst)).sum();
            let due = Instant::now() + Duration::from_micros(added);
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    }));
    while let Some((due, chunk)) = rx.recv().await {
        tokio::time::sleep_until(due).await;
        if state.wait_for(|s| !s.stalled).await.is_err() {
            return;
        }
        let mut chunk = chunk;
        if let Some(f) = &replies {
            let matched = {
                let p = f.pattern.lock().expect("pattern");
                (!p.is_empty() && chunk.starts_with(&p)).then_some(p.len())
            };
            if let Some(len) = matched
                && f.to_drop
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| d.checked_sub(1))
                    .is_ok()
            {
                f.dropped.fetch_add(1, Ordering::SeqCst);
                let replacement = f.replacement.lock().expect("replacement").clone();
                let Some(replacement) = replacement else {
                    // Both halves dropped: the client sees its connection die with the reply
                    // unsent.
                    return;
                };
                chunk.splice(..len, replacement);
            }
        }
        if to.write_all(&chunk).await.is_err() {
            return;
        }
    }
}
