use leasehold::{Fence, locked};

#[locked(key = "job")]
struct Job(Fence);

fn main() {
    let _ = Job;
}
