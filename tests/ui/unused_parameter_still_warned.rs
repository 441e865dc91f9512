// A parameter the function uses nowhere is still reported unused: `#[locked]` makes the body
// own only `_` names and those its key captures, so rustc's warning (here denied) stays.
#![deny(unused_variables)]

use leasehold::{Error, Locker, locked};

#[locked(key = "job:{id}", locker = Locker::memory())]
async fn run(id: u32, unused: u32, _kept: u32) -> Result<u8, Error> {
    Ok(1)
}

fn main() {
    let _: std::pin::Pin<Box<dyn std::future::Future<Output = Result<u8, Error>>>> =
        Box::pin(run(1, 2, 3));
}
