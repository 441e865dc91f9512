use leasehold::locked;

#[locked(key = "job")]
async fn run() -> impl std::fmt::Debug {
    42
}

fn main() {}
