// A trait method without a default body has nothing to run under the lease: refused where the
// body should be. The declaration is kept, so the impl below still implements it.
use leasehold::{Error, locked};

trait Job {
    #[locked(key = "job")]
    async fn run(&self) -> Result<(), Error>;
}

struct Noop;

impl Job for Noop {
    async fn run(&self) -> Result<(), leasehold::Error> {
        Ok(())
    }
}

fn main() {
    let _: &dyn std::future::Future<Output = Result<(), leasehold::Error>> = &Noop.run();
}
