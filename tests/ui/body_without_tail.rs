// A body of the wrong type (here a trailing `;` after its last expression) is reported at the
// body, as rustc reports it without the attribute, not at `#[locked(...)]`.
use leasehold::{Error, locked};

#[locked(key = "job")]
async fn run() -> Result<u32, Error> {
    let n = 7;
    Ok(n);
}

fn main() {
    let _: std::pin::Pin<Box<dyn std::future::Future<Output = Result<u32, Error>>>> =
        Box::pin(run());
}
