use leasehold::{current_fence, locked};

#[locked(key = "job")]
async fn run() {
    let _ = current_fence();
}

fn main() {
    let _: &dyn std::future::Future<Output = ()> = &run();
}
