// What a `tracing` subscriber writes, kept in memory for a test to read. Its own file, outside
// the support module, so that only the test binaries that install a subscriber build it (with
// `#[path]`), in this package and in lock-tower's, and lock-core's unit tests (with
// `include!`, hence no inner doc comment here).

use std::io::Write;
use std::sync::{Arc, Mutex};

use tracing_subscriber::fmt::MakeWriter;

/// Collects what the subscriber writes.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

impl Captured {
    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log buffer")).into_owned()
    }
}

/// A subscriber for this thread that writes what is logged at `max` and above into a new
/// [`Captured`], until the guard is dropped.
// Not every test binary that includes this file captures this way.
#[allow(dead_code)]
pub fn capture(max: tracing::Level) -> (Captured, tracing::subscriber::DefaultGuard) {
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(max)
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}
